"""The prefix cache (`engine.prefix_cache`) on its own and in the scheduler, driven by a runner
over a shadow pool: every slot holds the token written there, every token the fake model makes
is a function of what it reads back from its pages (and how many drafts it accepts, of what it
reads from the drafter's rows), and no write may land in a page another holder shares. So a
wrong page, a stale row or a write into a shared page changes the output or fails at once. No
model, no torch."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import SamplingParams
from engine.kv_cache import BlockAllocator, OutOfPages
from engine.prefix_cache import PrefixCache
from engine.request import Request
from engine.runner import PrefillInputs, StepInputs
from engine.scheduler import Scheduler

PAGE = 4
EOS = 999


def cache(num_pages: int = 16) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_pages), PAGE)


# ---- the trie on its own ------------------------------------------------------------------------


def test_matches_whole_pages_up_to_the_limit():
    c = cache()
    toks = list(range(1, 12))  # 2 whole pages and 3 tokens
    pages = c.alloc_pages(3)
    c.insert(toks, pages, None, upto=11)
    assert c.cached == 2  # the partial page is not cached
    assert c.match(toks, None, limit=11) == pages[:2]
    assert c.match(toks, None, limit=7) == pages[:1]  # a fresh prompt of 8: at most 7
    assert c.match(toks[:4] + [0] * 7, None, limit=11) == pages[:1]
    assert c.match([0] + toks[1:], None, limit=11) == []


def test_salts_keep_their_pages_apart():
    c = cache()
    toks = list(range(1, 9))
    c.insert(toks, c.alloc_pages(2), "a", upto=8)
    assert c.match(toks, "b", 8) == [] and c.match(toks, None, 8) == []
    assert len(c.match(toks, "a", 8)) == 2  # the same salt hits: the pair makes the test


def test_insert_is_idempotent_and_a_duplicate_stays_private():
    c = cache()
    toks = list(range(1, 9))
    mine = c.alloc_pages(2)
    cur = c.insert(toks, mine, None, 4)
    cur = c.insert(toks, mine, None, 8, cur)
    c.insert(toks, mine, None, 8)
    assert [c.alloc.refcount(p) for p in mine] == [2, 2]
    twin = c.alloc_pages(2)  # the same tokens computed again elsewhere
    c.insert(toks, twin, None, 8)
    assert [c.alloc.refcount(p) for p in twin] == [1, 1] and c.match(toks, None, 8) == mine
    c.release(twin)
    assert c.alloc.refcount(twin[0]) == 0 and c.evictable == 0


def test_eviction_is_least_recently_used_and_tail_first():
    c = cache(num_pages=7)  # 6 usable
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    pa, pb = c.alloc_pages(2), c.alloc_pages(2)
    c.insert(a, pa, None, 8)
    c.insert(b, pb, None, 8)
    c.release(pa)
    c.release(pb)
    assert c.evictable == 4 and c.available == 6
    c.match(a, None, 8)  # a is now the most recently used
    c.alloc_pages(3)  # 2 free, then evicts b's tail
    c.alloc_pages(2)  # b's head, then a's tail
    assert c.evicted == 3 and c.cached == 1
    assert c.match(b, None, 8) == [] and c.match(a, None, 8) == pa[:1]


def test_a_held_page_is_never_evicted():
    c = cache(num_pages=5)  # 4 usable
    toks = list(range(1, 9))
    p = c.alloc_pages(2)
    c.insert(toks, p, None, 8)
    c.release(p)
    other = c.match(toks, None, 8)
    c.hold(other)  # another request takes the cached prefix
    with pytest.raises(OutOfPages):
        c.alloc_pages(3)
    assert c.cached == 2 and c.alloc.num_free == 2  # the failed allocation evicted nothing
    c.alloc_pages(2)
    assert [c.alloc.refcount(x) for x in p] == [2, 2]


def test_evicting_a_page_takes_its_descendants_out_of_the_trie():
    c = cache()
    toks = list(range(1, 13))
    y = c.alloc_pages(1)  # one request cached the first page
    c.insert(toks, y, None, 4)
    x = c.alloc_pages(3)  # another computed all three and caches pages 2 and 3 under y's
    c.insert(toks, x, None, 12)
    assert c.match(toks, None, 12) == [y[0], x[1], x[2]]
    c.release(y)  # y's page is cached alone, its children held by x
    assert c.evict(1) == 1
    assert c.match(toks, None, 12) == [] and c.cached == 0
    assert [c.alloc.refcount(p) for p in x] == [1, 1, 1]  # x's pages are x's alone
    c.release(x)
    assert c.alloc.num_free == c.alloc.capacity


class CacheMachine(RuleBasedStateMachine):
    """Random admissions (over a cached prefix when there is one), inserts, releases and
    evictions over a small pool; after each, every page is exactly one of free, cached and held
    by nobody else (evictable), or held, with the allocator's counts equal to the holders'."""

    @initialize(num_pages=st.integers(4, 24))
    def setup(self, num_pages: int) -> None:
        self.c = cache(num_pages)
        self.reqs: list[tuple[list[int], list[int]]] = []  # (tokens, pages) of live requests

    @rule(family=st.integers(0, 2), extra=st.integers(0, 9), seed=st.integers(0, 99))
    def admit(self, family: int, extra: int, seed: int) -> None:
        rng = random.Random(seed)
        toks = [family + 1] * 8 + [rng.randrange(1, 4) for _ in range(extra)]
        hit = self.c.match(toks, None, len(toks) - 1)
        need = -(-len(toks) // PAGE) - len(hit)
        if need > self.c.room_with(hit):
            return
        self.c.hold(hit)
        pages = hit + self.c.alloc_pages(need)
        assert len(set(pages)) == len(pages)
        self.reqs.append((toks, pages))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), upto=st.integers(0, 20))
    def insert(self, i: int, upto: int) -> None:
        toks, pages = self.reqs[i % len(self.reqs)]
        self.c.insert(toks, pages, None, upto)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def release(self, i: int) -> None:
        toks, pages = self.reqs.pop(i % len(self.reqs))
        self.c.release(pages)

    @rule(n=st.integers(0, 5))
    def evict(self, n: int) -> None:
        self.c.evict(n)

    @invariant()
    def pages_are_accounted_for(self) -> None:
        c, a = self.c, self.c.alloc
        held = Counter(p for _, pages in self.reqs for p in pages)
        trie = set(c._node)
        for p in range(a.reserved, a.num_pages):
            assert a.refcount(p) == held[p] + (p in trie), p
            assert (p in c._lru) == (p in trie and held[p] == 0), p
        assert a.num_free + len(set(held) | trie) == a.capacity
        assert c.available == a.num_free + c.evictable

    def teardown(self) -> None:
        for _, pages in self.reqs:
            self.c.release(pages)
        self.c.reset()
        assert self.c.alloc.num_free == self.c.alloc.capacity and self.c.cached == 0


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ---- the scheduler over a shadow pool ------------------------------------------------------------


def h(seq: list[int]) -> int:
    """The fake model: a token from the context it read."""
    x = 7
    for t in seq:
        x = (x * 31 + t) % 1_000_003
    return 1 + x % 500


class ShadowRunner:
    """A runner over a shadow pool: `target` and `draft` map a slot to the token written there.
    Its tokens are `h` of the context it reads back through the row's pages (target rows below
    the cache length, then the anchor); how many drafts a step accepts is a function of what it
    reads from the drafter's rows (below `fed`), so a stale drafter row shows as another accepted
    length, never another token, as in the engine. `span` tokens a step when it drafts;
    `plain_from` rows or more decode plainly (one token, the drafter's rows left behind)."""

    def __init__(self, span: int = 4, plain_from: int = 99):
        self.span, self.plain_from = span, plain_from
        self.target: dict[int, int] = {}
        self.draft: dict[int, int] = {}
        self.sched: Scheduler | None = None
        self.computed = 0  # prompt tokens prefilled
        self.prefills: list[PrefillInputs] = []

    @property
    def shape(self):  # noqa: ANN201 - a duck-typed StepShape
        return type("Shape", (), {"max_emit": self.span, "drafts": True})()

    def coins_per_row(self, b: int) -> int:
        return self.span

    def step_shape(self, b: int, params: list, lagging: bool = False):  # noqa: ANN201
        drafts = b < self.plain_from
        return type("Shape", (), {"max_emit": self.span if drafts else 1, "drafts": drafts})()

    def _slot(self, pages: list[int], pos: int) -> int:
        return pages[pos // PAGE] * PAGE + pos % PAGE

    def _read(self, pool: dict[int, int], pages: list[int], n: int) -> list[int]:
        return [pool.get(self._slot(pages, p), -1) for p in range(n)]

    def _write(self, pool: dict[int, int], pages: list[int], pos: int, token: int) -> None:
        page = pages[pos // PAGE]
        assert self.sched is not None
        refs = self.sched.alloc.refcount(page)
        assert refs == 1, f"a write at position {pos} into page {page}, shared ({refs} refs)"
        pool[self._slot(pages, pos)] = token

    def prefill(self, inps: list[PrefillInputs]) -> list[int | None]:
        out = []
        for inp in inps:
            self.prefills.append(inp)
            self.computed += len(inp.tokens)
            ctx = self._read(self.target, inp.pages, inp.start)
            assert -1 not in ctx, "a prefill reads a row never written"
            for j, t in enumerate(inp.tokens):
                self._write(self.target, inp.pages, inp.start + j, t)
                self._write(self.draft, inp.pages, inp.start + j, t)
            out.append(None if inp.params is None else h(ctx + inp.tokens))
        return out

    def step(self, inp: StepInputs, pad: bool = False) -> tuple[list[list[int]], list[int]]:
        shape = self.step_shape(len(inp.anchor), inp.params)
        emitted, accepted = [], []
        for r, (anchor, n, pages) in enumerate(zip(inp.anchor, inp.cache_len, inp.pages)):
            lag = inp.lag[r] if shape.drafts and inp.lag else []
            for j, t in enumerate(lag):  # catch-up: the drafter's rows only
                self._write(self.draft, pages, n - len(lag) + j, t)
            ctx = self._read(self.target, pages, n)
            assert -1 not in ctx, "a step reads a row never written"
            toks, seq = [], ctx + [anchor]
            for _ in range(shape.max_emit):
                toks.append(h(seq))
                seq.append(toks[-1])
            acc = 0
            if shape.drafts:
                acc = h(self._read(self.draft, pages, n)) % shape.max_emit
            rows = [anchor] + toks[:acc]
            for j, t in enumerate(rows):  # the commit: root and accepted nodes
                self._write(self.target, pages, n + j, t)
                if shape.drafts:
                    self._write(self.draft, pages, n + j, t)
            emitted.append(toks[:acc + 1])
            accepted.append(acc)
        return emitted, accepted


def make(cached: bool, num_pages: int = 200, runner: ShadowRunner | None = None, **kw
         ) -> tuple[Scheduler, ShadowRunner]:
    runner = runner or ShadowRunner()
    s = Scheduler(runner, num_pages=num_pages, page_size=PAGE, vocab_size=1000,
                  max_batch_size=kw.pop("max_batch_size", 4), max_model_len=kw.pop("max_len", 400),
                  stop_ids=frozenset([EOS]), prefix_caching=cached, **kw)
    runner.sched = s
    return s, runner


def drain(s: Scheduler) -> None:
    for _ in range(10_000):
        if not s.has_work:
            return
        s.step()
        for r in s.running:  # every row writes only into pages it alone holds
            s.cache.check_writes(r.pages, min(r.cache_len, r.fed))
    raise AssertionError("the scheduler did not finish")


def serve(s: Scheduler, prompts: list[list[int]], n_new: int = 12, **kw) -> list[Request]:
    reqs = [Request(i, list(p), SamplingParams(max_new_tokens=n_new, **kw))
            for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    drain(s)
    return reqs


def both(prompts_of_turns: list[list[list[int]]], **kw):  # noqa: ANN201
    """Runs each turn's prompts through a cached and an uncached scheduler (a turn after the
    last one ended); returns both schedulers, runners and requests per turn."""
    out = {}
    for cached in (True, False):
        s, run = make(cached, **{k: v for k, v in kw.items() if k != "n_new"})
        out[cached] = (s, run, [serve(s, ps, kw.get("n_new", 12)) for ps in prompts_of_turns])
    return out[True], out[False]


def same(a: list[Request], b: list[Request]) -> None:
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.accept_lengths for r in a] == [r.accept_lengths for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]


def rand(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


@pytest.mark.parametrize("n", [16, 17, 31])  # 0, 1 and 15 past a page boundary of 16
def test_a_resent_prompt_hits_all_but_its_last_page(n):
    p = rand(n, n)
    (s, run, turns), (_, cold, cold_turns) = both([[p], [p]])
    for t, c in zip(turns, cold_turns):
        same(t, c)
    hit = (n - 1) // PAGE * PAGE
    assert turns[1][0].cached_tokens == hit and turns[0][0].cached_tokens == 0
    assert run.prefills[-1].start == hit and run.prefills[-1].tokens == p[hit:]
    assert run.computed == cold.computed - hit
    assert (s.prefix_queries, s.prefix_hits) == (2 * n, hit)


def test_an_agent_session_prefills_only_each_turns_new_tokens():
    rng = random.Random(0)
    prompt, cached, cold = rand(37, 1), [], []
    for turn in range(5):
        for c, store in ((True, cached), (False, cold)):
            if turn == 0:
                store.append(make(c))
            s, _ = store[0]
            store.append(serve(s, [prompt])[0])
        same([cached[-1]], [cold[-1]])
        r = cached[-1]
        if turn:
            assert r.cached_tokens >= (len(prev) // PAGE) * PAGE - PAGE  # noqa: F821
        prev = prompt  # noqa: F841
        prompt = prompt + r.output_ids + rand(rng.randrange(3, 20), turn + 10)
    s_c, run_c = cached[0]
    s_u, run_u = cold[0]
    assert run_c.computed < run_u.computed / 2


def test_concurrent_requests_share_a_system_prompt_and_n_choices_prefill_once():
    system = rand(40, 5)
    prompts = [system + rand(5 + i, 20 + i) for i in range(3)] + [system + [7, 8, 9]] * 4
    (s, run, [reqs]), (_, cold, [creqs]) = both([prompts], max_batch_size=8)
    same(reqs, creqs)
    starts = [inp.start for inp in run.prefills]
    # the identical four: one computes its prompt, the three after it hit all but a page
    full = [r for r in reqs if r.prompt_ids == prompts[-1]]
    hit = (len(prompts[-1]) - 1) // PAGE * PAGE
    assert sorted(r.cached_tokens for r in full) == [0, hit, hit, hit]
    assert run.computed < cold.computed and max(starts) > 0


@pytest.mark.parametrize("chunk", [8, 13])  # chunk ends on and off page boundaries
def test_chunked_prompts_insert_each_chunk_and_later_ones_hit(chunk):
    head = rand(50, 3)
    (s, run, turns), (_, _, cold) = both([[head + [1, 2]], [head + [3, 4, 5]]],
                                         prefill_chunk=chunk)
    for t, c in zip(turns, cold):
        same(t, c)
    assert turns[1][0].cached_tokens == 48


def test_a_lagging_drafter_cache_is_never_shared():
    # two rows decode plainly (the drafter's rows left behind), so their answers' pages hold
    # target rows the drafter never saw: only pages below `fed` may be cached
    runner = ShadowRunner(plain_from=2)
    p, q = rand(9, 7), rand(11, 8)
    s, run = make(True, runner=runner)
    first = serve(s, [p, q], n_new=20)
    for r in first:
        assert r.fed < r.cache_len or r.finished
    follow = [p + first[0].output_ids + [5], q + first[1].output_ids + [6]]
    warm = serve(s, [follow[0]], n_new=20)
    s2, _ = make(False, runner=ShadowRunner(plain_from=2))
    serve(s2, [p, q], n_new=20)
    coldr = serve(s2, [follow[0]], n_new=20)
    same(warm, coldr)
    assert warm[0].cached_tokens <= 12  # the prompt's fed pages, not the plain steps' ones


def test_preemption_keeps_pages_cached_and_resumption_recomputes_little():
    # 13 usable pages of 4: two requests of 30 tokens cannot both finish at once
    prompts = [rand(14, 30), rand(14, 31)]
    s, run = make(True, num_pages=14)
    reqs = serve(s, prompts, n_new=16)
    s2, cold = make(False, num_pages=200)
    creqs = serve(s2, prompts, n_new=16)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in creqs]
    assert s.num_preemptions > 0
    # a resumption recomputes only what the other request's growth evicted (its tail): the
    # head of its context was still cached
    resumed = [inp for inp in run.prefills if inp.params is None]
    assert resumed and all(0 < len(inp.tokens) < inp.start for inp in resumed)
    assert run.computed < cold.computed + sum(inp.start + len(inp.tokens) for inp in resumed)


def test_eviction_comes_before_preemption():
    prompts = [rand(20, 40 + i) for i in range(6)]
    s, run = make(True, num_pages=20, max_batch_size=2)
    reqs = serve(s, prompts, n_new=12)
    s2, _ = make(False, num_pages=200, max_batch_size=2)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in serve(s2, prompts, n_new=12)]
    assert s.cache.evicted > 0 and s.num_preemptions == 0


def test_a_small_pool_loses_nothing():
    rng = random.Random(4)
    shared = [rand(12, 50), rand(20, 51)]
    prompts = [rng.choice(shared) + rand(rng.randrange(1, 20), 60 + i) if i % 3 else
               rand(rng.randrange(5, 30), 80 + i) for i in range(30)]
    s, run = make(True, num_pages=26, max_batch_size=3)
    reqs = serve(s, prompts, n_new=10)
    s2, _ = make(False, num_pages=400, max_batch_size=3)
    creqs = serve(s2, prompts, n_new=10)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in creqs]
    assert all(r.finish_reason for r in reqs) and s.cache.evicted > 0
    assert s.cache.available == s.alloc.capacity  # nothing leaked
    s.cache.reset()
    assert s.alloc.num_free == s.alloc.capacity and s.cache.cached == 0


def test_a_recomputed_context_all_cached_makes_no_runner_call():
    s, run = make(True)
    r = Request(0, rand(15, 9), SamplingParams(max_new_tokens=30))
    s.add(r)
    while len(r.output_ids) < 2 or (r.cache_len % PAGE) != 0 or r.fed != r.cache_len:
        s.step()
    s._preempt(r)  # its context is now whole pages, all cached
    calls = len(run.prefills)
    s.step()
    assert len(run.prefills) == calls and r in s.running and r.cache_len == len(
        r.prompt_ids) + len(r.output_ids) - 1
    drain(s)
    s2, _ = make(False)
    assert r.output_ids == serve(s2, [r.prompt_ids], n_new=30)[0].output_ids


def test_a_failed_request_keeps_only_what_returned_calls_committed():
    s, run = make(True)
    p = rand(21, 10)
    bad = Request(0, p, SamplingParams(max_new_tokens=30))
    s.add(bad)
    for _ in range(4):
        s.step()
    assert bad.cache_len >= 28
    s.running.remove(bad)
    s._failed(bad, RuntimeError("boom"), True)  # its answer's rows are not trusted: not kept
    assert len(s.cache.match(p + bad.output_ids, None, 40)) == 5  # its prompt's, cached at
    # its prefill
    assert s.cache.available == s.alloc.capacity
    ok = Request(1, p, SamplingParams(max_new_tokens=30))
    s.add(ok)
    for _ in range(4):
        s.step()
    valid = min(ok.cache_len, ok.fed)
    s.abort(ok)  # an abort keeps what was committed
    assert len(s.cache.match(p + ok.output_ids, None, 40)) == valid // PAGE > 5


def test_turning_it_off_caches_nothing():
    p = rand(30, 11)
    s, run = make(False)
    serve(s, [p])
    r = serve(s, [p])[0]
    assert r.cached_tokens == 0 and s.cache.cached == 0
    assert (s.prefix_queries, s.prefix_hits) == (0, 0)
    assert s.alloc.num_free == s.alloc.capacity
