"""The scheduler on its own, driven by a fake runner: admission, page reservations, preemption
and recomputation, stop conditions, aborts. No model, no torch."""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.config import SamplingParams
from engine.request import Request
from engine.runner import PrefillInputs, StepInputs
from engine.scheduler import RequestRejected, Scheduler

PAGE = 4
EOS = 99


@dataclass
class FakeShape:
    max_emit: int
    drafts: bool = True


class FakeRunner:
    """Each step emits `emit` tokens per row, counting up from the row's anchor (`anchor + 1,
    anchor + 2, ...`); a prefill's first token is the last prompt token + 1. It records every
    call and checks that each row owns the pages the step may write."""

    def __init__(self, emit: int = 3, max_emit: int = 4):
        self.emit, self.shape = emit, FakeShape(max_emit)
        self.prefills: list[PrefillInputs] = []
        self.prefill_calls: list[int] = []  # inputs per prefill call
        self.steps: list[StepInputs] = []

    def coins_per_row(self, b: int) -> int:
        return 5

    def step_shape(self, b: int, params: list, lagging: bool = False) -> FakeShape:
        return self.shape

    def prefill(self, inps: list[PrefillInputs]) -> list[int | None]:
        self.prefill_calls.append(len(inps))
        self.prefills += inps
        assert all(len(inp.pages) * PAGE >= inp.start + len(inp.tokens) for inp in inps)
        return [None if inp.params is None else inp.tokens[-1] + 1 for inp in inps]

    def step(self, inp: StepInputs, pad: bool = False) -> tuple[list[list[int]], list[int]]:
        # the rows' page lists as they are now (the scheduler hands its own, which grow later)
        self.steps.append(replace(inp, pages=[list(p) for p in inp.pages]))
        span = self.step_shape(len(inp.anchor), inp.params, inp.lagging).max_emit
        for pages, n in zip(inp.pages, inp.cache_len):
            assert len(pages) * PAGE >= n + span, "a step may write past its pages"
        assert all(len(c) == 5 for c in inp.coins)
        emit = min(self.emit, span)
        emitted = [[a + j for j in range(1, emit + 1)] for a in inp.anchor]
        return emitted, [emit - 1] * len(emitted)


class SpanRunner(FakeRunner):
    """Plain decoding (one token a step, no drafting) while two or more rows run; a lone row
    drafts and may write 4 tokens a step."""

    def step_shape(self, b: int, params: list, lagging: bool = False) -> FakeShape:
        return FakeShape(1, drafts=False) if b >= 2 else self.shape


def scheduler(runner: FakeRunner, num_pages: int = 64, **kw) -> Scheduler:
    """A scheduler without the prefix cache (its pages go back to the free list as requests
    end); tests/test_prefix_cache.py runs the cached one."""
    return Scheduler(runner, num_pages=num_pages, page_size=PAGE, vocab_size=1000,
                     max_batch_size=kw.pop("max_batch_size", 4), max_model_len=200,
                     stop_ids=frozenset([EOS]), prefix_caching=kw.pop("prefix_caching", False),
                     **kw)


def run(s: Scheduler) -> None:
    while s.has_work:
        s.step()


def req(rid: int, prompt: list[int], **kw) -> Request:
    return Request(rid, prompt, SamplingParams(**kw))


def test_the_scheduler_holds_no_torch():
    for name in ("scheduler.py", "request.py", "prefix_cache.py"):
        tree = ast.parse((Path(__file__).parent.parent / "engine" / name).read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m and m.split(".")[0] == "torch" for m in mods), name


def test_requests_run_to_their_length_and_free_their_pages():
    r, s = FakeRunner(), None
    s = scheduler(r)
    free = s.alloc.num_free
    a, b = req(0, [1, 2, 3], max_new_tokens=7), req(1, [10, 11], max_new_tokens=2)
    s.add(a)
    s.add(b)
    run(s)
    assert a.output_ids == [4, 5, 6, 7, 8, 9, 10] and a.finish_reason == "length"
    assert b.output_ids == [12, 13] and b.finish_reason == "length"
    assert s.alloc.num_free == free and not a.pages and not b.pages
    # the prefill drew the first token; each step continued from the last one (the anchor)
    assert [p.tokens for p in r.prefills] == [[1, 2, 3], [10, 11]]
    assert r.steps[0].anchor == [4, 12] and r.steps[0].cache_len == [3, 2]


def test_batch_size_limits_admission():
    r = FakeRunner()
    s = scheduler(r, max_batch_size=2)
    for i in range(5):
        s.add(req(i, [i + 1], max_new_tokens=10))
    s.step()
    assert len(s.running) == 2 and len(s.waiting) == 3
    run(s)
    assert max(len(x.anchor) for x in r.steps) == 2



def test_waiting_requests_are_prefilled_together_up_to_the_chunk():
    """One prefill call takes every request admitted in a step while their padded size (rows
    times the longest) fits the chunk; a request longer than the chunk is prefilled in chunks,
    alone at first, its last chunk beside the next short request."""
    r = FakeRunner()
    s = scheduler(r, max_batch_size=3, prefill_chunk=12)
    lens = [3, 4, 5, 2, 20, 1]
    reqs = [req(i, [10 * i + 1] * n, max_new_tokens=2) for i, n in enumerate(lens)]
    for x in reqs:
        s.add(x)
    s.step()
    assert r.prefill_calls == [2]  # a third row would pad to 3 x 5 = 15 tokens
    run(s)
    # each pair finishes in one step: then [5, 2], the first 12 of 20 alone, its last 8
    # beside [1] (8 + 1 <= 12)
    assert r.prefill_calls == [2, 2, 1, 2]
    assert [(p.start, len(p.tokens)) for p in r.prefills] == [
        (0, 3), (0, 4), (0, 5), (0, 2), (0, 12), (12, 8), (0, 1)]
    assert r.prefills[4].params is None and r.prefills[5].params is not None
    for x in reqs:
        assert x.output_ids == [10 * x.rid + 2, 10 * x.rid + 3]


def test_a_long_prompt_prefills_in_chunks_while_the_batch_keeps_stepping():
    """A prompt longer than the chunk takes one chunk per engine step, each after the pages
    already written, while the running request steps in every engine step; the last chunk
    gives its first token."""
    r = FakeRunner(emit=1)
    s = scheduler(r, prefill_chunk=8)
    a = req(0, [5, 6], max_new_tokens=30)
    s.add(a)
    s.step()
    long = req(1, list(range(100, 130)), max_new_tokens=3)
    s.add(long)
    for _ in range(4):
        before = len(a.output_ids)
        s.step()
        assert len(a.output_ids) == before + 1  # the stream kept emitting
    chunks = [(p.start, len(p.tokens)) for p in r.prefills if p.tokens[0] >= 100]
    assert chunks == [(0, 8), (8, 8), (16, 8), (24, 6)]
    assert [p.tokens for p in r.prefills[1:]] == [list(range(100 + i, min(108 + i, 130)))
                                                  for i in range(0, 30, 8)]
    # its first token, then the step it joined in the same engine step
    assert long.output_ids == [130, 131] and long in s.running and not s.prefilling
    assert long.cache_len == long.fed == 31
    run(s)
    assert long.output_ids == [130, 131, 132] and a.finish_reason == "length"


def test_a_prompt_being_prefilled_is_preempted_first_and_recomputed():
    """When the running requests need pages the pool no longer has, the prompt being
    prefilled gives its pages back first (it has emitted nothing) and starts over later."""
    r = FakeRunner(emit=4, max_emit=4)
    s = scheduler(r, num_pages=14, prefill_chunk=8)
    a = req(0, [1] * 4, max_new_tokens=24)
    s.add(a)
    s.step()
    b = req(1, [2] * 40, max_new_tokens=2)  # admitted with 11 of 13 pages free
    s.add(b)
    run(s)
    assert s.num_preemptions == 1
    assert a.output_ids == list(range(2, 26)) and b.output_ids == [3, 4]
    # b's prefill: two chunks, preempted when a needed a page, then all five chunks
    starts = [p.start for p in r.prefills if p.tokens[0] == 2]
    assert starts == [0, 8, 0, 8, 16, 24, 32]
    assert s.alloc.num_free == 13


def test_each_step_reserves_only_its_own_span():
    """Pages follow the step's shape, not the widest one: rows of a plain-decoding batch hold
    pages for one more token (so attention reads no page beyond it); once one finishes, the
    lone row's drafting step gets room for its 4 tokens."""
    r = SpanRunner(emit=4, max_emit=4)
    s = scheduler(r)
    a, b = req(0, [1] * 7, max_new_tokens=12), req(1, [2] * 7, max_new_tokens=3)
    s.add(a)
    s.add(b)
    run(s)
    pair = [x for x in r.steps if len(x.anchor) == 2]
    alone = [x for x in r.steps if len(x.anchor) == 1]
    assert pair and alone and not any(pair[0].lag)
    for x in pair:
        assert [len(p) for p in x.pages] == [-(-(n + 1) // PAGE) for n in x.cache_len]
    assert len(alone[0].pages[0]) == -(-(alone[0].cache_len[0] + 4) // PAGE)
    # the first drafting step hands over what the plain steps committed without the drafter
    assert alone[0].lag == [a.output_ids[:alone[0].cache_len[0] - 7]]
    assert alone[0].lagging and not pair[0].lagging  # which the runner's shape may weigh
    assert len(a.output_ids) == 12 and a.output_ids == list(range(2, 14))
    assert s.alloc.num_free == 63


def test_stop_token_and_stop_string():
    r = FakeRunner(emit=4)
    detok = lambda ids: "".join(chr(96 + i % 26) for i in ids)  # noqa: E731
    s = scheduler(r, decoder=lambda: SimpleNamespace(pieces=lambda ids: [detok([i]) for i in ids],
                                                     flush=str))
    eos = req(0, [EOS - 3], max_new_tokens=50)  # prefill gives EOS-2, the step EOS-1, EOS
    stop = req(1, [0], max_new_tokens=50, stop=("cde",))  # tokens 1.. spell "abcdef..."
    s.add(eos)
    s.add(stop)
    run(s)
    assert eos.output_ids == [EOS - 2, EOS - 1] and eos.finish_reason == "stop"
    assert stop.finish_reason == "stop" and stop.text_end == detok(stop.output_ids).find("cde")


def test_preemption_recomputes_the_newest_request():
    """With too few pages for both, the newer request is preempted and later prefilled again
    from its prompt and output so far (without drawing a new first token)."""
    r = FakeRunner()
    s = scheduler(r, num_pages=12)  # 11 usable pages of 4 tokens
    old, new = req(0, [1] * 10, max_new_tokens=24), req(1, [2] * 10, max_new_tokens=24)
    s.add(old)
    s.add(new)
    run(s)
    assert s.num_preemptions >= 1
    again = [p for p in r.prefills if p.params is None]
    assert again and all(p.tokens[:10] == [2] * 10 for p in again)
    for x, start in ((old, 2), (new, 3)):
        assert len(x.output_ids) == 24 and x.finish_reason == "length"
        assert x.output_ids == list(range(start, start + 24))
    assert s.alloc.num_free == 11


def test_rejections_and_aborts():
    s = scheduler(FakeRunner(), num_pages=6)
    with pytest.raises(RequestRejected, match="empty"):
        s.add(req(0, []))
    with pytest.raises(RequestRejected, match="context limit"):
        s.add(req(1, [1] * 200))
    with pytest.raises(RequestRejected, match="KV pages"):
        s.add(req(2, [1] * 20, max_new_tokens=100))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        s.add(req(3, [5, 1000], max_new_tokens=4))
    x = req(4, [1, 2], max_new_tokens=8)
    s.add(x)
    s.step()
    assert x.pages
    s.abort(x)
    assert x.finish_reason == "abort" and not x.pages and not s.has_work
    assert s.alloc.num_free == 5


def test_a_pool_smaller_than_the_batch_runs_every_request_as_alone():
    """`max_batch_size x max_model_len` need not fit: a pool of one full context and a bit
    (the least `engine.memory.size_kv_pool` sizes) admits by free pages and preempts, and every
    request ends with the tokens it gets alone."""
    max_model_len = 200
    one_context = -(-(max_model_len + 4) // PAGE)  # a context plus the step's span, in pages
    prompts = [([i + 1] * (5 + 17 * i), 30 + 11 * i) for i in range(6)]

    def solo(prompt: list[int], n: int) -> list[int]:
        s = scheduler(FakeRunner())
        x = req(0, prompt, max_new_tokens=n)
        s.add(x)
        run(s)
        return x.output_ids

    s = scheduler(FakeRunner(), num_pages=1 + one_context + 3, max_batch_size=8)
    reqs = [req(i, p, max_new_tokens=n) for i, (p, n) in enumerate(prompts)]
    for x in reqs:
        s.add(x)
    steps = 0
    while s.has_work:
        s.step()
        steps += 1
        assert steps < 10_000, "the scheduler stopped making progress"
    assert s.num_preemptions > 0  # the pool was short, not only the batch
    for x, (p, n) in zip(reqs, prompts):
        assert x.finish_reason == "length" and x.output_ids == solo(p, n)
    assert s.alloc.num_free == s.alloc.capacity


def test_refusals_name_the_flag_to_turn():
    s = scheduler(FakeRunner(), num_pages=6)
    with pytest.raises(RequestRejected, match="--max-model-len"):
        s.add(req(0, [1] * 200))
    with pytest.raises(RequestRejected, match="the whole pool has 5 .*--kv-pages"):
        s.add(req(1, [1] * 20, max_new_tokens=100))
    assert not s.has_work


def test_each_token_is_decoded_once_into_the_events_pieces():
    """With a decoder, every kept token is pushed through its request's decoder once; each
    event carries a piece per new token (the last event one more: what a split character
    left), and the pieces add up to the request's text."""
    pushed: list[int] = []

    class Dec:
        def pieces(self, ids: list[int]) -> list[str]:
            pushed.extend(ids)
            return [chr(96 + i % 26) for i in ids]

        def flush(self) -> str:
            return "!"

    r = FakeRunner(emit=3)
    s = scheduler(r, decoder=Dec)
    a = req(0, [1, 2], max_new_tokens=7)
    s.add(a)
    events = []
    while s.has_work:
        events += s.step()
    assert sorted(pushed) == sorted(a.output_ids)  # once each
    for ev in events[:-1]:
        assert ev.pieces is not None and len(ev.pieces) == len(ev.new_ids)
    assert events[-1].finished and events[-1].pieces[-1] == "!"
    text = "".join(p for ev in events for p in ev.pieces)
    assert text == a.decoded


def test_a_stop_string_split_across_steps_is_found_far_into_a_long_output(monkeypatch):
    """The stop search looks only at the text's last (longest stop - 1) characters and the new
    text, whatever the output's length: a stop string spanning several steps, thousands of
    tokens in, is still found, `text_end` indexes the whole text, and that text is one whole
    decode of the output."""
    import engine.scheduler as sched

    piece = lambda t: f"{t},"  # the outputs count up: "2,3,4,...,2999,3000,..."
    dec = lambda: SimpleNamespace(pieces=lambda ids: [piece(i) for i in ids], flush=str)
    searched: list[int] = []
    find_stop = sched.find_stop
    monkeypatch.setattr(sched, "find_stop", lambda text, new_from, stops: (
        searched.append(len(text)), find_stop(text, new_from, stops))[1])
    stop = "".join(piece(t) for t in range(2994, 3001))  # 7 tokens: over three steps
    s = Scheduler(FakeRunner(emit=3), num_pages=2100, page_size=PAGE, vocab_size=1000,
                  max_batch_size=2, max_model_len=8000, decoder=dec)
    a = req(0, [1], max_new_tokens=5000, ignore_eos=True, stop=("never", stop))
    b = req(1, [1], max_new_tokens=4000, ignore_eos=True, stop=("never",))
    s.add(a)
    s.add(b)
    pieces: dict[int, list[str]] = {0: [], 1: []}
    while s.has_work:
        for ev in s.step():
            pieces[ev.req.rid] += ev.pieces
    whole = "".join(piece(t) for t in a.output_ids)
    assert a.finish_reason == "stop" and a.output_ids[-1] >= 3000
    assert a.text_end == whole.find(stop) and whole[a.text_end:].startswith(stop)
    assert a.decoded == whole == "".join(pieces[0])
    assert b.finish_reason == "length" and b.text_end is None and len(b.output_ids) == 4000
    assert b.decoded == "".join(piece(t) for t in b.output_ids) == "".join(pieces[1])
    # each search saw at most the held tail and one step's text (3 tokens of 5 characters)
    assert searched and max(searched) <= len(stop) - 1 + 3 * 5
