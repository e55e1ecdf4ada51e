"""Chunked prefill on the bundled pair: a prompt prefilled in chunks (each chunk's absorbed
attention over the pages already written, causal within itself) generates the tokens the
unchunked prefill does, at chunk ends on and off page boundaries, greedy and seeded, alone and
beside running requests; and its memory follows the chunk, not the prompt."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_cache import pages_needed
from engine.llm import DEFAULT_MODEL
from engine.runner import PrefillInputs
from engine.spec import prefill, prefill_chunk

PAGE = 16
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2800, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(progress=False, max_batch_size=4, page_size=PAGE)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams, chunk: int
           ) -> list[list[int]]:
    llm.scheduler.prefill_chunk = chunk
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.scheduler.prefill_chunk = 2048
    return [o.token_ids for o in outs]


def test_chunks_write_the_caches_the_whole_prefill_writes(llm):
    """Both caches' rows of every position and the last logits agree with one forward over
    the prompt, for chunks ending on page boundaries (16, 64) and off them (7, 100)."""
    models, pool = llm.models, llm.pool
    prompt = ids(230, 0)
    pages = list(range(1, 1 + pages_needed(230, PAGE)))
    ref_logits = prefill(models, pool, [prompt], [pages])[0]
    rows = pool.target[:, PAGE:PAGE + 230].clone(), pool.draft[:, PAGE:PAGE + 230].clone()
    for chunk in (7, 16, 64, 100):
        pool.target.zero_()
        pool.draft.zero_()
        for start in range(0, 230, chunk):
            piece = prompt[start:start + chunk]
            last = prefill_chunk(models, pool, piece, start, pages)
        assert last is not None and last.shape == ref_logits.shape
        assert (last - ref_logits).abs().max() < 1e-4, chunk
        assert (pool.target[:, PAGE:PAGE + 230] - rows[0]).abs().max() < 1e-4, chunk
        assert (pool.draft[:, PAGE:PAGE + 230] - rows[1]).abs().max() < 1e-4, chunk
        assert pool.target[:, PAGE + 230:].abs().max() == 0  # nothing written past the prompt


def test_runner_prefills_a_chunk_beside_whole_prompts(llm):
    """One runner call takes whole prompts (one forward) and a later chunk of another (a
    forward of its own); only inputs with sampling parameters get a token."""
    a, b = ids(40, 1), ids(50, 2)
    pa, pb = [1, 2, 3], [4, 5, 6, 7]
    first = llm.runner.prefill([PrefillInputs(b[:20], pb, None)])
    assert first == [None]
    both = llm.runner.prefill([PrefillInputs(b[20:], pb, GREEDY, start=20),
                               PrefillInputs(a, pa, GREEDY)])
    alone = llm.runner.prefill([PrefillInputs(b, pb, GREEDY), PrefillInputs(a, pa, GREEDY)])
    assert both == alone and None not in both


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunked_generation_is_token_identical(llm, params):
    """Alone, then beside running requests (the long prompt's chunks run between their
    steps): the same tokens at every chunk size as unchunked."""
    long, short = ids(300, 4), [ids(9, 5), ids(20, 6)]
    alone = tokens(llm, [long], params, 4096)
    beside = tokens(llm, [short[0], long, short[1]], params, 4096)
    assert beside[1] == alone[0]
    for chunk in (7, 16, 100):
        assert tokens(llm, [long], params, chunk) == alone, chunk
        assert tokens(llm, [short[0], long, short[1]], params, chunk) == beside, chunk


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _peak_growth(llm: LLM, prompt: list[int], chunk: int) -> tuple[list[int], int]:
    """The tokens of `prompt` prefilled in chunks of `chunk`, and the peak resident memory it
    took above what the process held before (Linux: `clear_refs` resets the peak)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss("VmRSS:")
    out = tokens(llm, [prompt], SamplingParams(max_new_tokens=4, ignore_eos=True), chunk)
    return out[0], _rss("VmHWM:") - base


def test_long_prompt_chunked_matches_transformers_in_a_quarter_of_the_memory():
    """A 1,536-token prompt: the same tokens in chunks of 256 as in one forward and as
    transformers; the chunked prefill's peak memory growth at most a quarter of the whole
    one's (its attention scores are chunk x context, not prompt x prompt)."""
    from transformers import DeepseekV3ForCausalLM

    llm = LLM(progress=False, max_batch_size=1)
    prompt = ids(1536, 7)
    llm.generate([{"prompt_token_ids": prompt[:40]}], GREEDY)  # first-call allocations
    whole, whole_bytes = _peak_growth(llm, prompt, 4096)
    chunked, chunked_bytes = _peak_growth(llm, prompt, 256)
    assert chunked == whole
    assert chunked_bytes <= whole_bytes / 4, (chunked_bytes, whole_bytes)
    del llm
    # NOTE: one forward over the prompt and what it generated (transformers' own incremental
    # decoding strays from its full forward by 0.1 in a logit at this length): each token is
    # the argmax after the ones before it.
    hf = DeepseekV3ForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + whole[:-1]])).logits[0, len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == whole
