"""The prefix cache on the bundled pair (fp32, the CPU): a request that hits generates exactly
the tokens a cold engine does, greedy and seeded, in tree, chain and ar modes, alone, batched,
chunked and after preemption, with the accepted lengths of a cold run (the drafter's rows were
restored with the target's); the rows a hit leaves in the pool agree with a cold prefill's
(`--tp 2` with the cache: `tests/test_parallel.py`). The cold reference is the same engine
with the cache turned off, so both runs share weights and pool."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import Request
from tests.test_chunked_prefill import GREEDY, PAGE, SEEDED, ids


@pytest.fixture(scope="module")
def llms() -> dict[str, LLM]:
    return {}


def engine(llms: dict[str, LLM], mode: str = "tree", **kw) -> LLM:
    key = json.dumps([mode, kw], sort_keys=True)
    if key not in llms:
        # NOTE: one tree budget at every batch size, so a row's accepted lengths do not depend
        # on what shares its steps (a cold and a warm run batch differently)
        llms[key] = LLM(mode=mode, progress=False, max_batch_size=4, page_size=PAGE, budget=8,
                        **kw)
    return llms[key]


@contextlib.contextmanager
def cold(llm: LLM):
    """The engine with its cache turned off (nothing matched, nothing kept)."""
    llm.scheduler.cache.enabled = False
    try:
        yield llm
    finally:
        llm.scheduler.cache.enabled = True


def run(llm: LLM, prompts: list, params: SamplingParams) -> list:
    return llm.generate([p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts],
                        params)


def check(warm: list, ref: list, greedy: bool) -> None:
    assert [o.token_ids for o in warm] == [o.token_ids for o in ref]
    if greedy:  # the drafter's cached rows give the accepted lengths of a cold run
        assert [o.accept_lengths for o in warm] == [o.accept_lengths for o in ref]


@pytest.mark.parametrize("mode", ["tree", "chain", "ar"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resent_prompt_hits_and_generates_the_cold_tokens(llms, mode, params):
    llm = engine(llms, mode)
    prompts = [ids(n, n) for n in (96, 97, 111)]  # 0, 1 and 15 past a page boundary
    with cold(llm):
        ref = run(llm, prompts, params)
    run(llm, prompts, params)  # fills the cache
    warm = run(llm, prompts, params)
    assert [o.cached_tokens for o in warm] == [(len(p) - 1) // PAGE * PAGE for p in prompts]
    check(warm, ref, params is GREEDY)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_conversation_and_a_shared_system_prompt(llms, params):
    llm = engine(llms)
    system = "You are a careful Python programmer. " * 12
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "def parse_args(argv):"}]
    first = run(llm, [{"messages": turn1}], params)[0]
    turn2 = turn1 + [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "now the tests"}]
    others = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
              for q in ("import os", "class Config:", "for line in open(path):")]
    prompts = [{"messages": turn2}] + [{"messages": m} for m in others]
    warm = run(llm, prompts, params)  # batched, all sharing the system prompt's pages
    with cold(llm):
        ref = run(llm, prompts, params)
    check(warm, ref, params is GREEDY)
    assert warm[0].cached_tokens >= len(first.prompt_token_ids) // PAGE * PAGE - PAGE
    assert all(o.cached_tokens >= 100 for o in warm[1:])


def test_seeded_choices_of_one_prompt_prefill_it_once(llms):
    llm = engine(llms)
    p = ids(150, 9)
    params = [SamplingParams(max_new_tokens=10, temperature=0.9, seed=s) for s in range(4)]
    llm.reset_prefix_cache()
    warm = llm.generate([{"prompt_token_ids": p}] * 4, params)
    assert sorted(o.cached_tokens for o in warm) == [0, 144, 144, 144]
    with cold(llm):
        ref = llm.generate([{"prompt_token_ids": p}] * 4, params)
    check(warm, ref, False)


@pytest.mark.parametrize("chunk", [32, 45])  # chunk ends on and off page boundaries
def test_a_long_prompt_over_a_cached_head_prefills_in_chunks(llms, chunk):
    llm = engine(llms)
    head = ids(120, 11)
    run(llm, [head + ids(5, 12)], GREEDY)
    llm.scheduler.prefill_chunk = chunk
    try:
        prompts = [head + ids(90, 13 + chunk), ids(30, 14 + chunk)]
        warm = run(llm, prompts, GREEDY)
        with cold(llm):
            ref = run(llm, prompts, GREEDY)
    finally:
        llm.scheduler.prefill_chunk = 2048
    check(warm, ref, True)
    assert warm[0].cached_tokens == 112


def test_preempted_requests_resume_over_their_cached_pages(llms):
    # a pool of 30 pages for 4 requests that grow to 11 pages each: preemptions, evictions
    llm = engine(llms, kv_pages=31)
    prompts = [ids(60, 20 + i) for i in range(4)]
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    s = llm.scheduler
    warm = run(llm, prompts, params)
    assert s.num_preemptions > 0 and s.cache.evicted > 0
    big = engine(llms)
    with cold(big):
        ref = run(big, prompts, params)
    check(warm, ref, False)


def test_a_hit_leaves_the_rows_a_cold_prefill_writes(llms):
    llm = engine(llms)
    pool, s = llm.pool, llm.scheduler
    p = ids(70, 30)
    rows = {}
    for warm in (False, True):
        if warm:
            run(llm, [p], GREEDY)  # cached
        with contextlib.nullcontext() if warm else cold(llm):
            req = Request(10_000 + warm, p, SamplingParams(max_new_tokens=64, ignore_eos=True))
            s.add(req)
            s.step()  # its prefill (and its first token)
            assert req.cached_tokens == (64 if warm else 0)
            slots = torch.tensor([req.pages[i // PAGE] * PAGE + i % PAGE for i in range(70)])
            rows[warm] = (pool.target[:, slots].clone(), pool.draft[:, slots].clone())
            while s.has_work:
                s.step()
    for a, b in zip(rows[True], rows[False]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
