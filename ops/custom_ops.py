"""The expert bank and the FP8 linear as torch custom ops, with fake kernels and FLOP formulas.

- `torch.ops.kimi.moe_experts(x, idx, w, w13, w2, block=0, add=None)`: float expert weights.
- `torch.ops.kimi.moe_experts_w4a16(x, idx, w, w13_packed, w13_scale, w2_packed, w2_scale,
  group_size=32, block=0, add=None)`: INT4 pack-quantized expert weights, dequantized per call.
- `torch.ops.kimi.moe_experts_fp8(x, idx, w, w13, w13_scale_inv, w2, w2_scale_inv,
  block_n=128, block_k=128, block=0, add=None)`: FP8 block expert weights, dequantized per
  call.
- `torch.ops.kimi.fp8_linear(x, w, scale_inv, block_n=128, block_k=128)`: FP8 block weights.
- `torch.ops.kimi.mla_prefix_attention(q_lat, q_pe, kv_cache, page_table, ctx_len, page_size,
  scale)` and `torch.ops.kimi.draft_context_attention(q, draft_cache, page_table, ctx_len,
  page_size, scale)`: attention over a paged cache whose work follows each row's length
  (`ops.attention_triton` on CUDA, the `ops.paged` twins elsewhere); each returns the output
  and its natural-log LSE.
- `torch.ops.kimi.mha_prefill(q, k_nope, k_pe, v, scale, causal, prev_o, prev_lse)`: one MHA
  prefill pass (`ops.prefill.MHAPass`: a chunk's queries over its own causal square or one
  up-projected prefix chunk, merged with the previous pass's result) -> output fp32 and LSE
  (`ops.prefill_triton` on CUDA, `ops.prefill.mha_attention` elsewhere).
- `torch.ops.kimi.rms_norm(x, weight, eps)`: RMSNorm of 16-bit rows `x [..., H]` as one kernel
  (`ops.norm_triton` on CUDA, `ops.norm.rms_norm` elsewhere); `torch.ops.kimi.add_rms_norm(x,
  delta, weight, eps)` -> `(x + delta, its norm)`, the residual add in the same kernel
  (`ops.norm.add_rms_norm` elsewhere).
- `torch.ops.kimi.rope_tail(x, cos, sin, nope)`: 16-bit `x [..., heads, D]` with its last
  `D - nope` channels rotated (DeepSeek's interleaved pairs, laid out de-interleaved) as one
  kernel (`ops.rope_triton` on CUDA, `ops.rope.rope_tail` elsewhere).

Shapes: `x [T, H]`, `idx/w [T, k]` (routing ids and weights; ids outside `[0, E)` are
dropped), `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]`, packed as in
`ops.quant.dequant_int4` or float8_e4m3fn with `*_scale_inv [E, ceil(rows/block_n),
ceil(cols/block_k)]` fp32 per matrix as in `ops.quant.dequant_fp8_block` -> `[T, H]` in x's
dtype (`block` is the alignment block; 0, the default, takes it, and on CUDA the kernels' whole
launch configuration, from `ops.moe.expert_tiles` by the token count `T`: 16-row blocks up to 512
tokens, 64 or 128 above); only the experts a call routes to are dequantized. `add [T, H]`
(x's dtype; the shared experts' output) is added to the routed sum, rounded as `out + add`
rounds, on CUDA inside the kernel that sums the slots.
`fp8_linear`: `x [..., K]`, `w [N, K]` float8_e4m3fn, `scale_inv [ceil(N/block_n),
ceil(K/block_k)]` fp32 -> `[..., N]`.

Dispatch: CUDA tensors run the Triton kernels (`ops.moe_triton`, `ops.quant_triton`) when
triton imports, otherwise (and on the CPU) the static-shape torch twins (`ops.moe.experts_aligned*`,
`ops.quant.fp8_linear_torch`). Triton is imported only on the first CUDA call.

Fake kernels give the output shape and dtype only, so the ops run under `FakeTensorMode` and
on the meta device. `FlopCounterMode`, once `register_flop_formulas()` ran, counts useful matmul
FLOPs: `2 * T*k * (2I*H + H*I)` for the experts (block padding not included; `ops.moe.moe_flops`
gives both numbers) and `2 * M*N*K` for the linear. Importing this module registers the ops once.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ops import paged
from ops.moe import (
    expert_block,
    experts_aligned,
    experts_aligned_fp8,
    experts_aligned_w4a16,
    moe_flops,
)
from ops.norm import add_rms_norm as add_rms_norm_torch
from ops.norm import rms_norm as rms_norm_torch
from ops.prefill import mha_attention, mha_flops
from ops.quant import fp8_linear_torch
from ops.rope import rope_tail as rope_tail_torch


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (the `gpu` extra); checked once."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(x: Tensor) -> bool:
    return x.device.type == "cuda" and triton_available()


def _plus(y: Tensor, add: Tensor | None) -> Tensor:
    """The routed sum plus the shared experts' output, rounded as transformers adds them."""
    return y if add is None else y + add


def _check_moe(x: Tensor, idx: Tensor, w: Tensor, w13_shape: tuple[int, ...], h13: int,
               w2_shape: tuple[int, ...], add: Tensor | None = None) -> None:
    """Shape checks shared by the fake kernels; `h13` is H as `w13` stores it (packed: H/8)."""
    torch._check(add is None or (tuple(add.shape) == tuple(x.shape) and add.dtype == x.dtype),
                 lambda: f"add {tuple(add.shape)} must be x's {tuple(x.shape)} {x.dtype}")
    torch._check(x.dim() == 2 and idx.dim() == 2, lambda: "x must be [T, H], idx [T, k]")
    torch._check(tuple(w.shape) == tuple(idx.shape) and idx.shape[0] == x.shape[0],
                 lambda: f"idx {tuple(idx.shape)} and w {tuple(w.shape)} must be [T, k]")
    torch._check(w13_shape[1] % 2 == 0 and w13_shape[2] == h13,
                 lambda: f"w13 {w13_shape} must be [E, 2I, H] (H={x.shape[1]}, stored {h13})")
    torch._check(w2_shape[0] == w13_shape[0] and w2_shape[1] == x.shape[1],
                 lambda: f"w2 {w2_shape} must be [E={w13_shape[0]}, H={x.shape[1]}, I]")


@torch.library.custom_op("kimi::moe_experts", mutates_args=())
def moe_experts(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor,
                block: int = 0, add: Tensor | None = None) -> Tensor:
    """Routed expert bank, float weights: `x [T, H]`, `idx/w [T, k]`, `w13 [E, 2I, H]`,
    `w2 [E, H, I]` -> `[T, H]` (plus `add [T, H]`)."""
    if _use_triton(x):
        from ops.moe_triton import moe_experts_triton

        return moe_experts_triton(x, idx, w, w13, w2, block, add=add)
    return _plus(experts_aligned(x, idx, w, w13, w2, expert_block(x.shape[0], block)), add)


@moe_experts.register_fake
def _moe_experts_fake(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor,
                      block: int = 0, add: Tensor | None = None) -> Tensor:
    _check_moe(x, idx, w, tuple(w13.shape), x.shape[1], tuple(w2.shape), add)
    return x.new_empty(x.shape)


@torch.library.custom_op("kimi::moe_experts_w4a16", mutates_args=())
def moe_experts_w4a16(x: Tensor, idx: Tensor, w: Tensor, w13_packed: Tensor,
                      w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
                      group_size: int = 32, block: int = 0, add: Tensor | None = None
                      ) -> Tensor:
    """Routed expert bank over INT4 pack-quantized weights: `w13_packed [E, 2I, H/8]` int32,
    `w13_scale [E, 2I, H/group]`, `w2_packed [E, H, I/8]`, `w2_scale [E, H, I/group]`."""
    if _use_triton(x):
        from ops.moe_triton import moe_experts_w4a16_triton

        return moe_experts_w4a16_triton(x, idx, w, w13_packed, w13_scale, w2_packed, w2_scale,
                                        group_size, block, add=add)
    return _plus(experts_aligned_w4a16(x, idx, w, w13_packed, w13_scale, w2_packed, w2_scale,
                                       group_size, expert_block(x.shape[0], block)), add)


@moe_experts_w4a16.register_fake
def _moe_experts_w4a16_fake(x: Tensor, idx: Tensor, w: Tensor, w13_packed: Tensor,
                            w13_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
                            group_size: int = 32, block: int = 0, add: Tensor | None = None
                            ) -> Tensor:
    torch._check(w13_packed.dtype == torch.int32 and w2_packed.dtype == torch.int32,
                 lambda: "packed expert weights must be int32")
    _check_moe(x, idx, w, tuple(w13_packed.shape), -(-x.shape[1] // 8), tuple(w2_packed.shape),
               add)
    return x.new_empty(x.shape)


@torch.library.custom_op("kimi::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w13_scale_inv: Tensor,
                    w2: Tensor, w2_scale_inv: Tensor, block_n: int = 128, block_k: int = 128,
                    block: int = 0, add: Tensor | None = None) -> Tensor:
    """Routed expert bank over FP8 block weights: `w13 [E, 2I, H]`, `w2 [E, H, I]`
    float8_e4m3fn, `w13_scale_inv [E, 2I/block_n, H/block_k]`, `w2_scale_inv [E, H/block_n,
    I/block_k]` fp32."""
    if _use_triton(x):
        from ops.moe_triton import moe_experts_fp8_triton

        return moe_experts_fp8_triton(x, idx, w, w13, w13_scale_inv, w2, w2_scale_inv,
                                      (block_n, block_k), block, add=add)
    return _plus(experts_aligned_fp8(x, idx, w, w13, w13_scale_inv, w2, w2_scale_inv,
                                     (block_n, block_k), expert_block(x.shape[0], block)), add)


@moe_experts_fp8.register_fake
def _moe_experts_fp8_fake(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w13_scale_inv: Tensor,
                          w2: Tensor, w2_scale_inv: Tensor, block_n: int = 128,
                          block_k: int = 128, block: int = 0, add: Tensor | None = None
                          ) -> Tensor:
    torch._check(w13.dtype == torch.float8_e4m3fn and w2.dtype == torch.float8_e4m3fn,
                 lambda: "FP8 expert weights must be float8_e4m3fn")
    _check_moe(x, idx, w, tuple(w13.shape), x.shape[1], tuple(w2.shape), add)

    def check_scale(name: str, t: Tensor, s: Tensor) -> None:
        want = (t.shape[0], -(-t.shape[1] // block_n), -(-t.shape[2] // block_k))
        torch._check(tuple(s.shape) == want,
                     lambda: f"{name}_scale_inv {tuple(s.shape)} != {want} for {tuple(t.shape)}")

    check_scale("w13", w13, w13_scale_inv)
    check_scale("w2", w2, w2_scale_inv)
    return x.new_empty(x.shape)


@torch.library.custom_op("kimi::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, w: Tensor, scale_inv: Tensor, block_n: int = 128,
               block_k: int = 128) -> Tensor:
    """`x [..., K]` times the FP8 block weight `w [N, K]` -> `[..., N]` in x's dtype."""
    if _use_triton(x):
        from ops.quant_triton import fp8_linear_triton

        return fp8_linear_triton(x, w, scale_inv, (block_n, block_k))
    return fp8_linear_torch(x, w, scale_inv, (block_n, block_k))


@fp8_linear.register_fake
def _fp8_linear_fake(x: Tensor, w: Tensor, scale_inv: Tensor, block_n: int = 128,
                     block_k: int = 128) -> Tensor:
    n, k = w.shape
    torch._check(x.shape[-1] == k, lambda: f"x's last dim {x.shape[-1]} != weight's K {k}")
    torch._check(tuple(scale_inv.shape) == (-(-n // block_n), -(-k // block_k)),
                 lambda: f"scale_inv {tuple(scale_inv.shape)} does not match weight {(n, k)}")
    return x.new_empty(*x.shape[:-1], n)


@torch.library.custom_op("kimi::mla_prefix_attention", mutates_args=())
def mla_prefix_attention(q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, page_table: Tensor,
                         ctx_len: Tensor, page_size: int, scale: float) -> tuple[Tensor, Tensor]:
    """MLA queries `[bs, Q, H, R]` / `[bs, Q, H, P]` against their rows' committed prefixes in
    the paged latent cache `[num_slots, R + P]` -> output `[bs, Q, H, R]` fp32, LSE `[bs, Q, H]`."""
    if _use_triton(q_lat):
        from ops.attention_triton import mla_prefix_attention as kernel

        return kernel(q_lat, q_pe, kv_cache, page_table, ctx_len, page_size, scale)
    return paged.mla_prefix_attention(q_lat, q_pe, kv_cache, page_table, ctx_len, page_size,
                                      scale)


@mla_prefix_attention.register_fake
def _mla_prefix_fake(q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, page_table: Tensor,
                     ctx_len: Tensor, page_size: int, scale: float) -> tuple[Tensor, Tensor]:
    return q_lat.new_empty(q_lat.shape, dtype=torch.float32), q_lat.new_empty(
        q_lat.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kimi::draft_context_attention", mutates_args=())
def draft_context_attention(q: Tensor, draft_cache: Tensor, page_table: Tensor, ctx_len: Tensor,
                            page_size: int, scale: float) -> tuple[Tensor, Tensor]:
    """The drafter's queries `[bs, M, nh, hd]` against their rows' paged context K/V
    `[num_slots, 2 * kvh * hd]` -> output `[bs, M, nh, hd]` fp32, LSE `[bs, M, nh]`."""
    if _use_triton(q):
        from ops.attention_triton import draft_context_attention as kernel

        return kernel(q, draft_cache, page_table, ctx_len, page_size, scale)
    return paged.draft_context_attention(q, draft_cache, page_table, ctx_len, page_size, scale)


@draft_context_attention.register_fake
def _draft_context_fake(q: Tensor, draft_cache: Tensor, page_table: Tensor, ctx_len: Tensor,
                        page_size: int, scale: float) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:-1],
                                                                  dtype=torch.float32)


def _moe_experts_flop(x_shape, idx_shape, w_shape, w13_shape, w2_shape, block: int = 0,
                      add_shape=None, *, out_shape=None, **kwargs) -> int:
    (T, k), (E, i2, H) = idx_shape, w13_shape
    return moe_flops(T, k, E, H, i2 // 2, expert_block(T, block))[0]


def _moe_experts_w4a16_flop(x_shape, idx_shape, w_shape, w13_packed_shape, w13_scale_shape,
                            w2_packed_shape, w2_scale_shape, group_size: int = 32,
                            block: int = 0, add_shape=None, *, out_shape=None,
                            **kwargs) -> int:
    (T, k), (E, i2) = idx_shape, w13_packed_shape[:2]
    return moe_flops(T, k, E, x_shape[1], i2 // 2, expert_block(T, block))[0]


def _moe_experts_fp8_flop(x_shape, idx_shape, w_shape, w13_shape, w13_scale_inv_shape, w2_shape,
                          w2_scale_inv_shape, block_n: int = 128, block_k: int = 128,
                          block: int = 0, add_shape=None, *, out_shape=None, **kwargs) -> int:
    (T, k), (E, i2, H) = idx_shape, w13_shape
    return moe_flops(T, k, E, H, i2 // 2, expert_block(T, block))[0]


def _fp8_linear_flop(x_shape, w_shape, scale_inv_shape, block_n: int = 128,
                     block_k: int = 128, *, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(x_shape[:-1]) * w_shape[0] * w_shape[1]


@torch.library.custom_op("kimi::mha_prefill", mutates_args=())
def mha_prefill(q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float, causal: bool,
                prev_o: Tensor | None = None, prev_lse: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """One MHA prefill pass: `q [B, T, H, Dn + P]` over `k_nope [B, N, H, Dn]`, `k_pe [B, N,
    P]`, `v [B, N, H, Dv]` (causal: `N == T`) -> output `[B, T, H, Dv]` fp32 and LSE `[B, T,
    H]` fp32, merged with `(prev_o, prev_lse)` when given."""
    if _use_triton(q):
        from ops.prefill_triton import mha_prefill_triton

        return mha_prefill_triton(q, k_nope, k_pe, v, scale, causal, prev_o, prev_lse)
    return mha_attention(q, k_nope, k_pe, v, scale, causal, prev_o, prev_lse)


@mha_prefill.register_fake
def _mha_prefill_fake(q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float,
                      causal: bool, prev_o: Tensor | None = None, prev_lse: Tensor | None = None
                      ) -> tuple[Tensor, Tensor]:
    B, T, H, _ = q.shape
    torch._check(k_nope.shape[:3] == v.shape[:3] and k_nope.shape[0] == B
                 and k_nope.shape[2] == H and k_pe.shape[:2] == k_nope.shape[:2],
                 lambda: f"k_nope {tuple(k_nope.shape)}, k_pe {tuple(k_pe.shape)}, v "
                         f"{tuple(v.shape)} do not fit q {tuple(q.shape)}")
    return (q.new_empty(B, T, H, v.shape[-1], dtype=torch.float32),
            q.new_empty(B, T, H, dtype=torch.float32))


def _mha_prefill_flop(q_shape, k_nope_shape, k_pe_shape, v_shape, scale: float, causal: bool,
                      prev_o_shape=None, prev_lse_shape=None, *, out_shape=None, **kwargs) -> int:
    B, T, H, dqk = q_shape
    return mha_flops(B, T, k_nope_shape[1], H, dqk, v_shape[-1], causal)


@torch.library.custom_op("kimi::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of `x [..., H]` with `weight [H]` (`ops.norm.rms_norm`), in x's dtype."""
    if _use_triton(x) and weight.dtype == x.dtype != torch.float32:
        from ops.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    torch._check(tuple(weight.shape) == (x.shape[-1],),
                 lambda: f"weight {tuple(weight.shape)} must be [{x.shape[-1]}]")
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("kimi::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`(x + delta, rms_norm(x + delta))` of `x, delta [..., H]` with `weight [H]`
    (`ops.norm.add_rms_norm`), in x's dtype."""
    if _use_triton(x) and weight.dtype == x.dtype == delta.dtype != torch.float32:
        from ops.norm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, delta, weight, eps)
    return add_rms_norm_torch(x, delta, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x: Tensor, delta: Tensor, weight: Tensor, eps: float
                       ) -> tuple[Tensor, Tensor]:
    torch._check(tuple(delta.shape) == tuple(x.shape),
                 lambda: f"delta {tuple(delta.shape)} must be x's {tuple(x.shape)}")
    s = torch.empty_like(x, dtype=torch.promote_types(x.dtype, delta.dtype))
    return s, _rms_norm_fake(s, weight, eps)


@torch.library.custom_op("kimi::rope_tail", mutates_args=())
def rope_tail(x: Tensor, cos: Tensor, sin: Tensor, nope: int) -> Tensor:
    """`x [..., heads, D]` with its last `D - nope` channels rotated by `cos/sin [..., (D -
    nope) / 2]` (`ops.rope.rope_tail`), a new tensor in x's dtype."""
    if _use_triton(x) and x.dtype != torch.float32:
        from ops.rope_triton import rope_tail_triton

        return rope_tail_triton(x, cos, sin, nope)
    return rope_tail_torch(x, cos, sin, nope)


@rope_tail.register_fake
def _rope_tail_fake(x: Tensor, cos: Tensor, sin: Tensor, nope: int) -> Tensor:
    half = (x.shape[-1] - nope) // 2
    torch._check(tuple(cos.shape) == (*x.shape[:-2], half) and cos.shape == sin.shape,
                 lambda: f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be "
                         f"{(*x.shape[:-2], half)}")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_FLOP_FORMULAS = {"moe_experts": _moe_experts_flop, "moe_experts_w4a16": _moe_experts_w4a16_flop,
                  "moe_experts_fp8": _moe_experts_fp8_flop, "fp8_linear": _fp8_linear_flop,
                  "mha_prefill": _mha_prefill_flop}


@functools.cache
def register_flop_formulas() -> None:
    """Teach `FlopCounterMode` the kimi:: ops' FLOPs; called where FLOPs are counted (the
    planner, the GPU check's layer, tests). Not at import: torch's flop counter imports
    Triton's JIT, 0.2 s that a serving process need not pay."""
    from torch.utils.flop_counter import register_flop_formula

    for name, formula in _FLOP_FORMULAS.items():
        register_flop_formula(getattr(torch.ops.kimi, name))(formula)
