"""The KV pool sized from memory (`engine.memory`): the rule's arithmetic, its flags, the
engine's start (the pool it logs, the refusal before loading weights that cannot leave room
for one context) and a pool smaller than the batch through `LLM`, token for token as alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.llm as llm_mod
from engine.config import EngineConfig, ModelConfig, SamplingParams
from engine.memory import (
    CUDA_OVERHEAD_BYTES,
    KVMemoryError,
    activation_reserve,
    checkpoint_bytes,
    parse_size,
    size_kv_pool,
)
from ops.prefill import TORCH_MHA

REPO = Path(__file__).resolve().parent.parent
PAGE_BYTES = 16 * 1000  # page_size 16, 1000 bytes a token


def size(budget: int, **kw):
    args = dict(budget_bytes=budget, used_bytes=10_000_000, reserve_bytes=5_000_000,
                bytes_per_token=1000, page_size=16, max_model_len=1000, pages_per_context=64,
                max_batch_size=8, budget_flag="--cpu-memory-budget 1GB", tp=2)
    return size_kv_pool(**{**args, **kw})


@pytest.mark.parametrize("text,expect", [
    ("17179869184", 17179869184), ("16GB", 16e9), ("16 gb", 16e9), ("8GiB", 8 * 2**30),
    ("1.5TB", 1.5e12), ("512MiB", 512 * 2**20), (4096, 4096), ("100k", 100_000)])
def test_sizes_parse_in_decimal_and_binary_units(text, expect):
    assert parse_size(text) == int(expect)


@pytest.mark.parametrize("text", ["lots", "16XB", "", "-1GB", "0", True])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match="size|positive"):
        parse_size(text)


def test_the_pool_takes_what_is_left_after_used_and_reserve():
    s = size(15_000_000 + 100 * PAGE_BYTES + PAGE_BYTES - 1)
    assert s.num_pages == s.fit_pages == 100 and s.cap_pages == 1 + 8 * 64
    assert s.tokens == 99 * 16 and s.contexts == 1 and s.pool_bytes == 100 * PAGE_BYTES
    assert "1,584 tokens" in s.describe() and "1 full 1,000-token context " in s.describe()


def test_without_the_prefix_cache_the_pool_is_capped_at_every_slot_at_full_context():
    s = size(10**12, prefix_caching=False)
    assert s.num_pages == s.cap_pages == 1 + 8 * 64 and s.fit_pages > s.cap_pages
    assert s.contexts == 8 and "capped" in s.describe() and s.cache_tokens == 0


def test_with_the_prefix_cache_the_pool_takes_what_memory_holds():
    s = size(15_000_000 + 900 * PAGE_BYTES)
    assert s.num_pages == s.fit_pages == 900 > s.cap_pages == 1 + 8 * 64
    assert s.cache_tokens == (900 - 513) * 16
    assert f"{s.cache_tokens:,} tokens past every batch slot" in s.describe()


def test_the_least_pool_is_the_dummy_page_and_one_context():
    assert size(15_000_000 + 65 * PAGE_BYTES).num_pages == 65
    for budget in (15_000_000 + 64 * PAGE_BYTES, 1000, 0):
        with pytest.raises(KVMemoryError) as e:
            size(budget)
        msg = str(e.value)
        for flag in ("--max-model-len 1,000", "--tp (now 2", "--gpu-memory-utilization",
                     "--cpu-memory-budget 1GB"):
            assert flag in msg, (flag, msg)


def test_the_reserve_covers_a_step_a_prefill_and_on_cuda_the_overhead():
    mc = ModelConfig.from_dir(REPO / "configs" / "kimi-k2.5-text")
    kw = dict(tp=8, max_batch_size=8, step_rows=25, prefill_tokens=2048, dtype_bytes=2)
    cpu = activation_reserve(mc, **kw, cuda=False, prefill_score_bytes=0)
    cuda = activation_reserve(mc, **kw, cuda=True, prefill_score_bytes=0)
    assert cpu.overhead == 0 and cuda.overhead == CUDA_OVERHEAD_BYTES
    assert cuda.total == cpu.total + CUDA_OVERHEAD_BYTES
    assert cpu.step == 3 * 8 * 25 * mc.vocab_size * 4
    # every layer's 2048 cache rows (listed, then stacked) at least
    assert cpu.prefill > 2 * 61 * 2048 * 576 * 2
    # the twin's scores: 8 bytes per query, key and head of the chunk's square (8 heads a rank)
    twin = activation_reserve(mc, **kw, cuda=True, prefill_score_bytes=8)
    assert twin.prefill - cuda.prefill == 8 * 2048 * 2048 * 8


def test_the_prefill_reserve_counts_the_scores_the_engine_would_materialize():
    """Flash passes (the Triton kernel, flashinfer's ragged prefill) on CUDA materialize no
    scores; the torch backend's twin, and every pass on the CPU, does."""
    from engine.attention import prefill_score_bytes
    from ops.custom_ops import triton_available

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    flash = 0 if triton_available() else TORCH_MHA.score_bytes(cuda)
    assert prefill_score_bytes("auto", cuda) == prefill_score_bytes("triton", cuda) == flash
    assert prefill_score_bytes("flashinfer", cuda) == flash
    assert prefill_score_bytes("torch", cuda) == TORCH_MHA.score_bytes(cuda) == 8
    assert all(prefill_score_bytes(w, cpu) == 8 for w in ("auto", "triton", "torch"))


def test_checkpoint_bytes_reads_the_index():
    model = REPO / "models" / "kimi-mini"
    files = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    assert 0.9 * files < checkpoint_bytes(model) <= files
    assert checkpoint_bytes(REPO / "configs" / "kimi-k2.5-text") == 0
    assert checkpoint_bytes(None) == 0


def test_the_flags_are_engine_config_fields():
    c = EngineConfig()
    assert c.gpu_memory_utilization == 0.9 and c.cpu_memory_budget is None
    assert EngineConfig(cpu_memory_budget=2**30).cpu_memory_budget == str(2**30)
    with pytest.raises(ValueError, match="cpu_memory_budget"):
        EngineConfig(cpu_memory_budget="lots")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


# ---- through the engine (the bundled pair) --------------------------------------------------


def test_no_room_for_one_context_stops_before_the_weights_load(monkeypatch):
    def no(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(llm_mod, "load_models", no)
    with pytest.raises(KVMemoryError, match="--max-model-len 4,096.*--tp.*"
                                            "--gpu-memory-utilization"):
        llm_mod.LLM(cpu_memory_budget="1MB", progress=False)


def test_a_pool_smaller_than_the_batch_gives_every_request_its_tokens_alone(capsys):
    big = llm_mod.LLM(max_model_len=64, cpu_memory_budget="8GB", progress=True, warm_up=False,
                      enable_prefix_caching=False)
    s = big.kv_size
    assert s.num_pages == s.cap_pages and s.source == "memory"
    assert f"KV pool: {s.tokens:,} tokens" in capsys.readouterr().err
    # a budget for the dummy page and two full contexts
    ppc = s.pages_per_context
    budget = s.used_bytes + s.reserve_bytes + (1 + 2 * ppc) * 16 * s.bytes_per_token
    small = llm_mod.LLM(max_model_len=64, cpu_memory_budget=str(budget), progress=False,
                        warm_up=False)
    assert small.kv_size.num_pages == 1 + 2 * ppc and small.kv_size.contexts == 2
    assert small.scheduler.alloc.capacity == 2 * ppc
    # one page short of one context: the weights load (as stored they leave room), then the
    # pool cannot be sized
    with pytest.raises(KVMemoryError, match="--max-model-len 64"):
        llm_mod.LLM(max_model_len=64, progress=False, warm_up=False, cpu_memory_budget=str(
            s.used_bytes + s.reserve_bytes + ppc * 16 * s.bytes_per_token))
    prompts = [[(7 * i + j) % 3000 + 1 for j in range(8 + 9 * i)] for i in range(5)]
    params = [SamplingParams(max_new_tokens=40 - 6 * i, ignore_eos=True) for i in range(5)]
    outs = small.generate(prompts, params)
    assert small.stats["preemptions"] > 0  # the pool, not the batch, was the limit
    for p, sp, o in zip(prompts, params, outs):
        alone = big.generate([p], sp)[0]
        assert o.token_ids == alone.token_ids and o.finish_reason == alone.finish_reason


def test_generate_names_every_refused_prompt_before_any_runs(tmp_path, capsys):
    from engine import generate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n'
                       '{"prompt_token_ids": [' + ", ".join(["5"] * 40) + ']}\n'
                       '{"prompt_token_ids": [4, 5]}\n'
                       '{"prompt_token_ids": [' + ", ".join(["6"] * 33) + ']}\n')
    out = tmp_path / "out.jsonl"
    rc = generate.main(["--prompts", str(prompts), "--output", str(out), "--max-model-len", "32",
                        "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    refused = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert refused == [f"error: {prompts}:2: the prompt has 40 tokens; the context limit is 32 "
                       f"(--max-model-len: prompt plus at least one new token)",
                       f"error: {prompts}:4: the prompt has 33 tokens; the context limit is 32 "
                       f"(--max-model-len: prompt plus at least one new token)"]
