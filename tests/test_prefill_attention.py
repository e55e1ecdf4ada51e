"""Prefill attention in the MHA form (`ops.prefill`): the Triton pass (`ops.prefill_triton`)
against its torch twin under Triton's interpreter, at several prefix and chunk lengths (chunk
ends on and off page boundaries, prefixes cut into several up-projected chunks); the whole
chunk attention against one dense softmax over every key; the twin's live bytes against its
`score_bytes`; the custom op's fake kernel and FLOPs; the kernel's sm_90a compile (`wgmma`, no
spills); flashinfer's ragged pass's glue on a stand-in flashinfer; the router's 16-bit path
against transformers'; and the engine's chunked prefill through the interpreted kernel.

Tolerances: fp32 `rtol=1e-5, atol=2e-5` (summation order only); bf16 (bf16 dot inputs and
probabilities in the kernel, fp32 math in the twin) `rtol=atol=1e-2`.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from engine.spec import slot_of
from ops.prefill import (
    TORCH_MHA,
    MHAPass,
    Prefix,
    merge_with_lse,
    mha_attention,
    mha_flops,
    mla_prefill,
    prefix_chunk,
)

try:
    from ops import prefill_triton as pt
except ImportError:  # triton is in the optional `gpu` extra
    pt = None

from tests.test_paged_attention import _ptxas, compile_sm90  # triton's bundled ptxas, or None

needs_triton = pytest.mark.skipif(pt is None, reason="triton is not installed")
FP32 = dict(rtol=1e-5, atol=2e-5)
BF16 = dict(rtol=1e-2, atol=1e-2)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
PS = 16  # page size of the paged cases


def _pass_inputs(B, T, N, H, dn, dp, dv, dtype, seed=0, latent=40):
    """Queries and one key set as the model hands them over: `k_nope`/`v` strided slices of
    one `kv_b_proj` output, `k_pe` a slice of the latent rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, dn + dp, generator=g).to(dtype)
    kvb = torch.randn(B, N, H, dn + dv, generator=g).to(dtype)
    lat = torch.randn(B, N, latent + dp, generator=g).to(dtype)
    return q, kvb[..., :dn], lat[..., latent:], kvb[..., dn:]


def _dense(q, k_nope, k_pe, v, scale, visible):
    """One plain softmax over every key, `visible [T, N]`: the definition."""
    dn = k_nope.shape[-1]
    s = (torch.einsum("bqhd,bkhd->bhqk", q[..., :dn].double(), k_nope.double())
         + torch.einsum("bqhd,bkd->bhqk", q[..., dn:].double(), k_pe.double())) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double())


def test_twin_is_the_causal_softmax_and_merges_like_one_softmax():
    q, kn, kp, v = _pass_inputs(2, 9, 9, 3, 8, 4, 6, torch.float64)
    o, lse = mha_attention(q, kn, kp, v, 0.4, True)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(o, _dense(q, kn, kp, v, 0.4, causal).float(), **FP32)
    # a second key set merged by LSE equals one softmax over both
    q2, kn2, kp2, v2 = _pass_inputs(2, 9, 5, 3, 8, 4, 6, torch.float64, seed=1)
    o2, lse2 = mha_attention(q, kn2, kp2, v2, 0.4, False, o, lse)
    both = torch.cat([torch.ones(9, 5, dtype=torch.bool), causal], 1)
    ref = _dense(q, torch.cat([kn2, kn], 1), torch.cat([kp2, kp], 1), torch.cat([v2, v], 1), 0.4,
                 both)
    torch.testing.assert_close(o2, ref.float(), **FP32)
    # an empty side weighs nothing
    o3, l3 = merge_with_lse(o, lse, torch.zeros_like(o), torch.full_like(lse, float("-inf")))
    torch.testing.assert_close(o3, o)
    torch.testing.assert_close(l3, lse)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,causal,prev,tiles", [
    (37, 37, True, False, None),  # ragged causal square, default tiles
    (70, 70, True, True, (32, 16)),  # several diagonal tiles, merged into a previous pass
    (64, 64, True, False, (64, 64)),  # exactly one tile
    (37, 53, False, True, None),  # a prefix chunk with a ragged last key tile
    (20, 128, False, False, (16, 64)),  # whole key tiles only
    (1, 1, True, False, None),  # a one-token chunk
])
def test_kernel_equals_twin(device, dtype, T, N, causal, prev, tiles):
    H, dn, dp, dv = 3, 16, 8, 24
    q, kn, kp, v = (t.to(device) for t in _pass_inputs(2, T, N, H, dn, dp, dv, dtype))
    po = pl = None
    if prev:
        g = torch.Generator().manual_seed(5)
        po = torch.randn(2, T, H, dv, generator=g).to(device)
        pl = torch.randn(2, T, H, generator=g).to(device)
    bm, bn = tiles or (None, None)
    o, lse = pt.mha_prefill_triton(q, kn, kp, v, 0.3, causal, po, pl, block_m=bm, block_n=bn)
    o2, lse2 = mha_attention(q, kn, kp, v, 0.3, causal, po, pl)
    tol = FP32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(o, o2, **tol)
    torch.testing.assert_close(lse, lse2, **tol)


@needs_triton
def test_kernel_at_kimi_head_widths_in_bf16():
    """128 nope + 64 rope, 128-wide values, the GPU's 128 x 64 tiles."""
    q, kn, kp, v = _pass_inputs(1, 100, 100, 2, 128, 64, 128, torch.bfloat16, latent=512)
    o, lse = pt.mha_prefill_triton(q, kn, kp, v, 0.07, True)
    o2, lse2 = mha_attention(q, kn, kp, v, 0.07, True)
    torch.testing.assert_close(o, o2, **BF16)
    torch.testing.assert_close(lse, lse2, **BF16)


class _Interpreted(MHAPass):
    """The Triton pass called directly (on CPU tensors: the interpreter), as CUDA runs it."""

    def __call__(self, q, k_nope, k_pe, v, scale, causal, prev_o=None, prev_lse=None):
        return pt.mha_prefill_triton(q, k_nope, k_pe, v, scale, causal, prev_o, prev_lse)


def _paged_chunk(start: int, n: int, dtype: torch.dtype, B: int = 1, seed: int = 0):
    """A chunk of `n` queries at positions `start ..` over a prefix of `start` latent rows in
    shuffled pages of `PS` slots (each row its own pages; page 0 unused), with its own latent
    rows, and `kv_b_proj` as a linear: `(q, own rows, up, Prefix or None, widths)`."""
    H, dn, dp, dv, R = 2, 16, 8, 12, 32
    g = torch.Generator().manual_seed(seed)
    live = -(-start // PS)
    num_pages = 1 + B * live + 2
    cache = torch.randn(num_pages * PS, R + dp, generator=g).to(dtype)
    table = (torch.randperm(num_pages - 1, generator=g)[:B * live] + 1).view(B, live)
    up = torch.nn.Linear(R, H * (dn + dv), bias=False).to(dtype)
    with torch.no_grad():
        up.weight.copy_(torch.randn(H * (dn + dv), R, generator=g) / R ** 0.5)
    own = torch.randn(B, n, R + dp, generator=g).to(dtype)
    q = torch.randn(B, n, H, dn + dp, generator=g).to(dtype)
    prefix = (Prefix(cache, slot_of(table, torch.arange(start)[None].expand(B, -1), PS))
              if start else None)
    return q, own, up, prefix, (H, dn, dp, dv, R)


def _chunk_attention(q, own, up, prefix, dims, attend, chunk=None):
    H, dn, dp, dv, R = dims
    B, n = own.shape[:2]
    with torch.no_grad():
        kvb = up(own[..., :R]).view(B, n, H, dn + dv)
        return mla_prefill(q, kvb[..., :dn], own[..., R:], kvb[..., dn:], 0.25, attend,
                           prefix, up, chunk)


@pytest.mark.parametrize("start,n,chunk", [
    (0, 40, None),  # a first chunk: no prefix
    (32, 16, None),  # prefix and chunk end on page boundaries
    (37, 29, 64),  # both off them
    (200, 7, 64),  # a prefix of four up-projected chunks, the last ragged
    (130, 50, 128),
])
def test_chunk_attention_is_one_softmax_over_prefix_and_own_keys(start, n, chunk):
    q, own, up, prefix, dims = _paged_chunk(start, n, torch.float64)
    H, dn, dp, dv, R = dims
    got = _chunk_attention(q, own, up, prefix, dims, TORCH_MHA, chunk)
    cached = prefix.cache[prefix.slots[0]][None] if prefix else own[:, :0]
    lat = torch.cat([cached, own], 1)  # [1, start + n, R + P]
    with torch.no_grad():
        kvb = up(lat[..., :R]).view(1, start + n, H, dn + dv)
    visible = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    ref = _dense(q, kvb[..., :dn], lat[..., R:], kvb[..., dn:], 0.25, visible)
    torch.testing.assert_close(got, ref.float(), **FP32)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,n,chunk", [(0, 33, None), (48, 16, None), (37, 29, 64),
                                           (200, 7, 64)])
def test_chunk_attention_kernel_equals_twin(dtype, start, n, chunk):
    q, own, up, prefix, dims = _paged_chunk(start, n, dtype, B=2 if start == 0 else 1)
    got = _chunk_attention(q, own, up, prefix, dims, _Interpreted(), chunk)
    ref = _chunk_attention(q, own, up, prefix, dims, TORCH_MHA, chunk)
    torch.testing.assert_close(got, ref, **(FP32 if dtype == torch.float32 else BF16))


def test_prefix_chunks_are_bounded():
    """Kimi at tp 8 (8 heads, 256-wide keys and values, a 576-wide latent, bf16): a flash pass
    takes 12,736 prefix keys at a time (64 MiB of latent rows, keys and values), the twin,
    which materializes its scores, fewer as the chunk grows."""
    assert prefix_chunk(1, 4096, 8, 256, 576, 2, 0) == 12736
    assert prefix_chunk(1, 4096, 8, 256, 576, 2, 8) == 192
    assert prefix_chunk(1, 1, 1, 1, 1, 4, 0, budget=10) == 64  # at least one key tile
    assert prefix_chunk(3, 100, 4, 32, 48, 4, 8) % 64 == 0


@pytest.mark.parametrize("causal", [True, False])
def test_the_twin_holds_what_its_score_bytes_say(causal):
    """Live device bytes of one twin pass (counted on the meta device by the rehearsal's
    `DeviceMode`) stay within `score_bytes` per query, key and head, plus the causal mask's
    byte per (query, key) and the rows' own tensors."""
    from graphs.rehearse import DeviceMode

    B, T, H, dn, dp, dv = 1, 512, 4, 16, 8, 16
    N = T if causal else 2 * T
    q, k_nope, k_pe, v = (torch.empty(*shape, dtype=torch.bfloat16, device="meta") for shape in
                          ((B, T, H, dn + dp), (B, N, H, dn), (B, N, dp), (B, N, H, dv)))
    mode = DeviceMode()
    with mode.phase() as t:
        mha_attention(q, k_nope, k_pe, v, 0.1, causal)
    pairs = B * H * T * N
    rows = 4 * (B * T * H * (dn + dp) + B * N * H * (dn + dp + dv)) * 2  # fp32 copies, outputs
    assert pairs * TORCH_MHA.score_bytes(q.device) <= t.activation_bytes
    assert t.activation_bytes <= pairs * TORCH_MHA.score_bytes(q.device) + T * N + rows


def test_op_fake_shapes_and_flops():
    from torch.utils.flop_counter import FlopCounterMode

    from ops.custom_ops import register_flop_formulas

    register_flop_formulas()
    q, kn, kp, v = (t.to("meta") for t in _pass_inputs(2, 10, 30, 3, 16, 8, 12, torch.bfloat16))
    with FlopCounterMode(display=False) as fc:
        o, lse = torch.ops.kimi.mha_prefill(q, kn, kp, v, 0.3, False, None, None)
    assert o.shape == (2, 10, 3, 12) and o.dtype == torch.float32 and lse.shape == (2, 10, 3)
    assert fc.get_total_flops() == mha_flops(2, 10, 30, 3, 24, 12, False) == 2 * 2 * 3 * 300 * 36
    assert mha_flops(1, 4, 4, 1, 1, 1, True) == 2 * 10 * 2  # 10 (query, key) pairs
    # on the CPU the op is the twin
    q, kn, kp, v = _pass_inputs(1, 6, 6, 2, 16, 8, 12, torch.float32)
    o, lse = torch.ops.kimi.mha_prefill(q, kn, kp, v, 0.3, True, None, None)
    o2, lse2 = mha_attention(q, kn, kp, v, 0.3, True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


# ---- sm_90a -----------------------------------------------------------------------------------


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _compile_sm90(cases: list[tuple]) -> list[tuple[tuple, dict]]:
    """The kernel compiled for sm_90a as the JIT launches it (16-divisible strides and aligned
    pointers carry Triton's divisibility hint, as at Kimi's shapes): each case's MMA
    instruction, registers, spills and shared memory."""
    import ops.prefill_triton as pt

    out = []
    for case in cases:
        dtype, dn, dp, dv, causal, prev = case
        meta, warps = pt.mha_meta(DTYPES[dtype], "cuda", dn, dp, dv, causal, prev)
        fn = pt._mha_prefill_fwd
        sig, attrs = {}, {}
        for i, a in enumerate(fn.arg_names):
            if a in meta:
                sig[a] = "constexpr"
            elif a.endswith("_ptr"):
                fp32 = a in ("po_ptr", "plse_ptr", "o_ptr", "lse_ptr")
                sig[a] = "*fp32" if fp32 else "*" + dtype
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[a] = "fp32" if a == "qk_scale" else "i32"
                if a.startswith("s"):  # strides
                    attrs[(i,)] = [["tt.divisibility", 16]]
        r = compile_sm90(fn, sig, meta, warps, attrs)
        out.append((case, dict(r, block_m=meta["BLOCK_M"], warps=warps)))
    return out


@needs_triton
@pytest.mark.skipif(_ptxas() is None, reason="triton's NVIDIA backend (ptxas) is missing")
def test_mha_kernel_compiles_to_wgmma_without_spills():
    """Every variant the engine launches at Kimi's widths (bf16: `mla_prefill`'s own causal
    square, first and alone, and each prefix chunk merging into the pass before it) compiles
    for sm_90a to `wgmma` on 128-query tiles with no spills, in shared memory an H200 has;
    fp32 (tiny models on CUDA; fp32 weights at Kimi's widths fit no GPU) and the bundled
    model's widths spill nothing either. No GPU needed: Triton compiles, ptxas reports."""
    kimi = [("bf16", 128, 64, 128, True, False), ("bf16", 128, 64, 128, False, True)]
    other = [("fp32", 16, 16, 16, True, True), ("bf16", 16, 16, 16, False, True)]
    for case, r in _compile_sm90(kimi + other):
        assert r["spills"] == 0 and r["shared_bytes"] <= 227 * 1024, (case, r)
        if case in kimi:
            assert r["mma"] == "wgmma" and r["block_m"] == 128 and r["warps"] == 8, (case, r)


# ---- flashinfer's ragged prefill, on a stand-in ----------------------------------------------


class _FakeRagged:
    """`flashinfer.BatchPrefillWithRaggedKVCacheWrapper` as far as `FlashInferRaggedMHA` uses
    it: plan, then run returning flashinfer's base-2 LSE."""

    plans = 0

    def __init__(self, workspace, layout):
        assert layout == "NHD"

    def plan(self, qo_indptr, kv_indptr, hq, hk, qk, head_dim_vo, causal, sm_scale,
             q_data_type, kv_data_type):
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu"
        type(self).plans += 1
        self.qo, self.kv = qo_indptr.tolist(), kv_indptr.tolist()
        self.causal, self.scale, self.vo = causal, sm_scale, head_dim_vo

    def run(self, q, k, v, return_lse):
        outs, lses = [], []
        for b in range(len(self.qo) - 1):
            qb, kb = q[self.qo[b]:self.qo[b + 1]], k[self.kv[b]:self.kv[b + 1]]
            vb = v[self.kv[b]:self.kv[b + 1]]
            s = torch.einsum("qhd,khd->hqk", qb.double(), kb.double()) * self.scale
            if self.causal:
                s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            lse = torch.logsumexp(s, -1)
            outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vb.double()))
            lses.append((lse / torch.log(torch.tensor(2.0, dtype=torch.float64))).T)
        return torch.cat(outs).to(q.dtype), torch.cat(lses).float()


def test_flashinfer_ragged_pass_glue(monkeypatch):
    from ops import attention_gpu

    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithRaggedKVCacheWrapper = _FakeRagged
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    assert attention_gpu.ragged_prefill_unavailable(192, 128, torch.bfloat16) is None
    assert "head widths" in attention_gpu.ragged_prefill_unavailable(32, 16, torch.bfloat16)
    assert "16-bit" in attention_gpu.ragged_prefill_unavailable(192, 128, torch.float32)
    ragged = attention_gpu.FlashInferRaggedMHA("cpu", workspace_bytes=16)
    q, own, up, prefix, dims = _paged_chunk(130, 20, torch.float32)
    got = _chunk_attention(q, own, up, prefix, dims, ragged, 64)
    ref = _chunk_attention(q, own, up, prefix, dims, TORCH_MHA, 64)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    # one plan per shape: the square, a full prefix chunk and the last (3 of 130 keys x 64)
    assert _FakeRagged.plans == 3
    _chunk_attention(q, own, up, prefix, dims, ragged, 64)
    assert _FakeRagged.plans == 3


# ---- the router ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_router_16_bit_path_routes_as_transformers(device):
    """The bundled model in bf16, its routers narrowed to their stored bf16 values (at load off
    the CPU): the 16-bit inputs' products summed in fp32 (CUDA: `mm(..., out_dtype=float32)`
    on the tensor cores; the CPU: the same products in fp32) route every token as
    transformers' fp32 router does, with logits equal to its up to fp32 rounding."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from engine.llm import DEFAULT_MODEL
    from engine.models.kimi import KimiForCausalLM, Router, router_logits

    model = KimiForCausalLM.from_dir(DEFAULT_MODEL, device, torch.bfloat16, progress=False)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if device == "cpu":  # narrowed at load off the CPU only
        assert routers and all(r.narrow_(torch.bfloat16) for r in routers)  # stored in bf16
    assert routers and all(r.weight.dtype == torch.bfloat16 for r in routers)
    g = torch.Generator().manual_seed(0)
    hf_cfg = types.SimpleNamespace(**{k: getattr(model.cfg, k) for k in (
        "num_experts_per_tok", "hidden_size", "routed_scaling_factor", "n_group",
        "topk_group", "norm_topk_prob")}, num_local_experts=model.cfg.n_routed_experts)
    worst, same = 0.0, 0
    for r in routers:
        hf = DeepseekV3TopkRouter(hf_cfg).to(device)
        hf.weight.data = r.weight.float()
        hf.e_score_correction_bias.data = r.e_score_correction_bias.clone()
        x = torch.randn(512, model.cfg.hidden_size, generator=g).to(device, torch.bfloat16)
        ref_logits, ref_w, ref_idx = hf(x)
        logits = router_logits(x, r.weight)
        assert logits.dtype == torch.float32
        worst = max(worst, (logits - ref_logits).abs().max().item())
        idx, w = r(x)
        same += int((idx.sort(-1).values == ref_idx.sort(-1).values).all(-1).sum())
        torch.testing.assert_close(w.gather(1, idx.argsort(-1)), ref_w.gather(
            1, ref_idx.argsort(-1)), rtol=1e-5, atol=1e-6)
    assert same == 512 * len(routers) and worst < 1e-5, (same, worst)


# ---- the engine ------------------------------------------------------------------------------


@needs_triton
def test_chunked_prefill_through_the_interpreted_kernel_equals_the_twin():
    """The engine's prefill of the bundled pair (fp32), its first chunk and two later ones
    (ends off page boundaries) through the Triton pass under the interpreter: the caches'
    rows and the last logits equal the twin's."""
    from engine import LLM
    from engine.kv_cache import pages_needed
    from engine.spec import prefill, prefill_chunk

    llm = LLM(progress=False, max_batch_size=1, page_size=PS)
    models, pool = llm.models, llm.pool
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 2800, (90,), generator=g).tolist()
    pages = list(range(1, 1 + pages_needed(90, PS)))

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool.target.zero_()
        pool.draft.zero_()
        prefill(models, pool, [prompt[:37]], [pages])
        prefill_chunk(models, pool, prompt[37:70], 37, pages)
        last = prefill_chunk(models, pool, prompt[70:], 70, pages)
        return last, pool.target[:, PS:PS + 90].clone(), pool.draft[:, PS:PS + 90].clone()

    ref = run()
    att = models.attention
    att.prefill_pass = lambda: _Interpreted()  # the instance's hook, this test only
    try:
        got = run()
    finally:
        del att.prefill_pass
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def hf_and_llm():
    from transformers import DeepseekV3ForCausalLM

    from engine import LLM
    from engine.llm import DEFAULT_MODEL

    hf = DeepseekV3ForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    return hf, LLM(progress=False, max_batch_size=2, page_size=PS)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_chunked_prefill_in_the_mha_form_matches_transformers(hf_and_llm, seeded):
    """The bundled pair in fp32 on the CPU, a 150-token prompt prefilled whole and in chunks
    ending on page boundaries (16, 48) and off them (7, 50): the same tokens at every chunk
    size; greedy, each token is transformers' argmax after the ones before it; greedy or
    seeded, each token's log-probability is transformers' (its full forward over the prompt
    and the tokens before it), so a seeded run draws from transformers' distributions."""
    from engine import SamplingParams

    hf, llm = hf_and_llm
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=1,
                            **(dict(temperature=0.8, top_p=0.9, seed=5) if seeded else {}))
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 2800, (150,), generator=g).tolist()
    runs = {}
    for chunk in (4096, 16, 48, 7, 50):
        llm.scheduler.prefill_chunk = chunk
        try:
            runs[chunk] = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        finally:
            llm.scheduler.prefill_chunk = 2048
    whole = runs[4096].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + whole[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(whole)[:, None])[:, 0]
    if not seeded:
        assert logits.argmax(-1).tolist() == whole
    for chunk, out in runs.items():
        assert out.token_ids == whole, chunk
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert (got - ref).abs().max() < 1e-4, (chunk, got, ref)
