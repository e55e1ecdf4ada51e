"""The path that ships, on a checkpoint stored as Kimi K2.5 stores one (bf16, routed experts
INT4 pack-quantized, Kimi's attention widths: `bench.gpu_check_model`), loaded by
`engine.llm.LLM` as the engine loads any (default `--attention auto`, `--dtype auto`).

Without CUDA (in every test run; a second or two): the pair is stored in K2.5's layout, and it
loads and generates on the CPU, the torch backend, the paged kernels' twins and plain decoding
giving the same tokens. With CUDA (`cuda`-marked; bench/gpu_check.sh runs this file): on bf16
with the backend the engine picks there (flashinfer's MLA kernel where it imports, else the
paged Triton kernels), with INT4 experts through the Triton expert GEMMs,

- every captured step, at every batch size, replays what the eager step over the same loaded
  buffers computes, token for token, greedy and seeded sampled;
- `LLM.generate` with the auto backend gives `--attention torch`'s tokens in fp32, where both
  must agree exactly; in bf16 (where an ulp moves a near-tie, or a routing choice, and the
  two runs part) each emits, nearly always, the token an fp32 forward over its own text
  chooses.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from bench.gpu_check_model import DRAFT_BLOCK, write_pair
from engine.config import SamplingParams
from engine.llm import LLM, GenerationOutput
from engine.models.kimi import KimiForCausalLM
from ops.attention_gpu import mla_backend
from tests.graph_helpers import (
    mixed_params,
    prefilled,
    random_prompts,
    replay_against_eager,
    request_slots,
)

SIZES = [1, 2, 4, 8]
BUDGET = 6
MAX_LEN = 128
KV_PAGES = 1 + 8 * 10  # every captured row at MAX_LEN in pages of 16, and the dummy page
ENGINE = dict(budget=BUDGET, max_model_len=MAX_LEN, kv_pages=KV_PAGES, progress=False)
# How often, at least, each bf16 run emits the fp32 forward's argmax: the torch backend and the
# paged kernels' twins did 0.93 to 0.96 on the CPU (8 to 16 prompts x 32 tokens; one ulp moves
# a near-tie or a routing choice); broken attention or experts emit next to none of them.
AGREEMENT = 0.8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("shipping"))


# ---- without CUDA ---------------------------------------------------------------------------


def test_the_pair_is_stored_as_kimi_k25_stores_its_weights(pair):
    target, draft = pair
    cfg = json.loads((target / "config.json").read_text())
    widths = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    assert [cfg[k] for k in widths] == [512, 64, 128, 128]
    assert cfg["num_attention_heads"] > 1 and cfg["torch_dtype"] == "bfloat16"
    quant = cfg["quantization_config"]
    assert (quant["quant_method"], quant["format"]) == ("compressed-tensors", "pack-quantized")
    weights = quant["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, True)
    with safe_open(target / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    experts = {n: d for n, d in dtypes.items() if ".mlp.experts." in n}
    assert experts and {(n.rsplit("_", 1)[-1], d) for n, d in experts.items()} == {
        ("packed", "I32"), ("scale", "BF16"), ("shape", "I32")}
    rest = {d for n, d in dtypes.items() if n not in experts and "e_score_correction" not in n}
    assert rest == {"BF16"}
    assert json.loads((draft / "config.json").read_text())["block_size"] == DRAFT_BLOCK
    # flashinfer's MLA kernels plan these widths on Hopper (the bundled model's they do not)
    assert mla_backend(cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], torch.bfloat16, 90) == "fa3"


def test_the_pair_loads_and_generates_on_the_cpu(pair):
    """The engine's CPU pick (torch attention, float32), the paged kernels' twins
    (`--attention triton`) and plain decoding emit the same greedy tokens."""
    target, draft = pair
    cpu = dict(ENGINE, device="cpu", max_batch_size=2, budget=4)
    prompts, params = random_prompts(2), SamplingParams(max_new_tokens=6, ignore_eos=True)
    llm = LLM(target, draft, **cpu)
    assert llm.models.attention.name == "torch" and llm.pool.target.dtype == torch.float32
    bank = llm.models.target.expert_bank()
    assert bank is not None and bank.fmt == "int4"
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert [len(t) for t in want] == [6, 6]
    paged = LLM(target, draft, attention="triton", **cpu)
    assert paged.models.attention.name == "paged"
    assert [o.token_ids for o in paged.generate(prompts, params)] == want
    ar = LLM(target, mode="ar", **cpu)
    assert [o.token_ids for o in ar.generate(prompts, params)] == want


# ---- with CUDA ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(pair):
    """The engine as it starts on this GPU: bf16, the backend `auto` picks, graphs captured
    for every size in SIZES."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return LLM(*pair, max_batch_size=max(SIZES), capture_sizes=SIZES, **ENGINE)


@pytest.mark.cuda
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_captured_steps_equal_the_eager_step_at_every_batch_size(engine, sample,
                                                                 record_property):
    """Every real batch size from 1 to the largest captured one (so every padded size): the
    replayed graph and the eager step, same kernels over the same loaded buffers, emit the
    same tokens and write the same cache rows."""
    runner, pool = engine.runner, engine.pool
    record_property("attention", engine.models.attention.name)
    assert runner.use_graphs and pool.target.dtype == torch.bfloat16
    assert engine.models.target.expert_bank().fmt == "int4"
    assert {(bs, s) for bs in SIZES for s in runner.shapes_of(bs)} <= set(runner.graphs)
    for b in range(1, max(SIZES) + 1):
        reqs = prefilled(engine.models, pool, runner.shape, random_prompts(b),
                         mixed_params(b, sample), runner=runner)
        (emit, accept, after), (emit_ref, accept_ref, ref) = replay_against_eager(runner, reqs)
        assert torch.equal(emit, emit_ref) and torch.equal(accept, accept_ref), b
        real = request_slots(reqs, pool.page_size).cuda()
        torch.testing.assert_close(after.target[:, real], ref.target[:, real])
        torch.testing.assert_close(after.draft[:, real], ref.draft[:, real])
        pool.target.zero_()  # the next batch size prefills onto the same pages
        pool.draft.zero_()


def _agreement(ref: KimiForCausalLM, prompts: list[list[int]],
               outs: list[GenerationOutput]) -> float:
    """The share of emitted tokens that are `ref`'s argmax after the text before them."""
    hits = total = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids[:-1]], device="cuda")
        logits, _ = ref(ids)
        chosen = logits[0, len(prompt) - 1:].argmax(-1).tolist()
        hits += sum(a == b for a, b in zip(chosen, out.token_ids))
        total += len(out.token_ids)
    return hits / total


@pytest.mark.cuda
def test_generate_in_bf16_follows_the_fp32_forward_as_torch_does(pair, engine,
                                                                  record_property):
    torch_engine = LLM(*pair, attention="torch", max_batch_size=max(SIZES), capture_sizes=SIZES,
                       **ENGINE)
    prompts, params = random_prompts(8), SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = KimiForCausalLM.from_dir(pair[0], "cuda", torch.float32, progress=False)
    auto = _agreement(ref, prompts, engine.generate(prompts, params))
    plain = _agreement(ref, prompts, torch_engine.generate(prompts, params))
    record_property("agreement", f"{engine.models.attention.name} {auto:.3f}, torch {plain:.3f}")
    assert min(auto, plain) >= AGREEMENT, (auto, plain)


@pytest.mark.cuda
def test_generate_with_the_auto_backend_equals_torch_in_fp32(pair, record_property):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fp32 = dict(ENGINE, dtype="float32", max_batch_size=4)
    auto, plain = LLM(*pair, **fp32), LLM(*pair, attention="torch", **fp32)
    record_property("attention", auto.models.attention.name)
    prompts = random_prompts(4)
    for sample in (False, True):
        params = [replace(p, max_new_tokens=24, ignore_eos=True) for p in mixed_params(4, sample)]
        got = [o.token_ids for o in auto.generate(prompts, params)]
        assert got == [o.token_ids for o in plain.generate(prompts, params)]
