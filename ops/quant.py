"""INT4 pack-quantized and FP8 block (de)quantization, in the checkpoint formats Kimi ships.

INT4 (compressed-tensors `pack-quantized`, symmetric, group size 32): a linear `[out, in]` is stored
as `weight_packed` int32 `[out, ceil(in/8)]`, `weight_scale` `[out, ceil(in/group)]` and
`weight_shape` `[2]`. Eight 4-bit values along the input dimension per int32 word, value `i` in bits
`4i..4i+3` (lowest nibble first), each stored as `q + 8` for `q` in `[-8, 7]`;
`W[o, c] = q[o, c] * scale[o, c // group]`.

FP8 block: `float8_e4m3fn` weights with fp32 `weight_scale_inv` `[ceil(out/b0), ceil(in/b1)]`;
despite the name, `W[i, j] = w[i, j] * scale_inv[i // b0, j // b1]`.

The packing/quantizing side is used by the checkpoint writer (`tools.make_tiny`).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def _nibble_shifts(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[0, 4, .., 28]`, the bit offset of each of a word's eight values, made on `device`.

    NOTE: `arange` fills it on the device; `torch.tensor` of a Python tuple would copy it from
    pageable host memory on every call (a sync on CUDA, and not allowed in graph capture)."""
    return torch.arange(0, 32, 4, dtype=dtype, device=device)


def _expand_cols(scale: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    """[rows, ceil(cols/group)] -> [rows, cols], each scale repeated over its group."""
    return scale.repeat_interleave(group, dim=-1)[..., :cols]


def dequant_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int] | torch.Tensor,
    group_size: int = 32,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Unpack `packed` [out, ceil(in/8)] int32 with `scale` [out, ceil(in/group)] to [out, in].

    The product is formed in fp32 and cast to `dtype` once. With `shape` a tuple it reads
    nothing on the host (a checkpoint's `weight_shape` tensor is read once, at load).
    """
    if isinstance(shape, torch.Tensor):
        shape = tuple(int(x) for x in shape.tolist())
    out_f, in_f = int(shape[0]), int(shape[1])
    if packed.dtype != torch.int32:
        raise TypeError(f"weight_packed must be int32, got {packed.dtype}")
    shifts = _nibble_shifts(torch.int32, packed.device)
    # NOTE: >> on int32 is arithmetic, so a word with its top bit set (a negative int32) gets
    # sign bits shifted in from the left; masking with 0xF keeps only the four bits that were at
    # 4i..4i+3, which is all we want, so negative words decode correctly.
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [out, in/8, 8]
    q = nib.reshape(packed.shape[0], -1)[:out_f, :in_f].to(torch.float32) - 8.0
    s = _expand_cols(scale.to(torch.float32), group_size, in_f)
    return (q * s).to(dtype)


def pack_int4(
    w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize `w` [out, in] symmetrically per group of `group_size` input columns.

    Returns `(weight_packed int32 [out, ceil(in/8)], weight_scale [out, ceil(in/group)],
    weight_shape int32 [2])`. The scale is `max|w| / 7` over the group (rounded to `scale_dtype`),
    so every value maps into `[-7, 7]`: the grid stays symmetric and the largest magnitude is
    represented exactly, at the cost of never using the code -8. A `w` whose groups are
    `q * s` with integer `q` in `[-7, 7]`, `max|q| = 7` and `s` representable in `scale_dtype`
    round-trips exactly. All-zero groups get scale 1 (any scale would do; it avoids 0/0).
    """
    if w.dim() != 2:
        raise ValueError(f"pack_int4 expects a 2-D weight, got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    w32 = w.detach().to(torch.float32)
    n_groups = -(-in_f // group_size)
    padded = torch.zeros(out_f, n_groups * group_size, dtype=torch.float32, device=w.device)
    padded[:, :in_f] = w32
    amax = padded.view(out_f, n_groups, group_size).abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(scale_dtype)
    # Quantize against the stored (rounded) scale so dequantization sees the same grid.
    q = torch.round(w32 / _expand_cols(scale.to(torch.float32), group_size, in_f))
    q = q.clamp(-8, 7).to(torch.int64) + 8
    n_words = -(-in_f // 8)
    codes = torch.full((out_f, n_words * 8), 8, dtype=torch.int64, device=w.device)
    codes[:, :in_f] = q
    shifts = _nibble_shifts(torch.int64, w.device)
    words = (codes.view(out_f, n_words, 8) << shifts).sum(dim=-1)  # in [0, 2^32)
    # Reinterpret the unsigned 32-bit word as two's-complement int32.
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    shape = torch.tensor([out_f, in_f], dtype=torch.int32)
    return words, scale, shape


def dequant_fp8_block(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`w` [out, in] float8 times `scale_inv` [ceil(out/b0), ceil(in/b1)] broadcast per block.

    Edge blocks may be partial (out or in not a multiple of the block); their scale still comes
    from the last row/column of `scale_inv`.
    """
    out_f, in_f = w.shape
    b0, b1 = block
    expect = (-(-out_f // b0), -(-in_f // b1))
    if tuple(scale_inv.shape) != expect:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{(out_f, in_f)} with block {block} (expected {expect})")
    s = scale_inv.to(torch.float32).repeat_interleave(b0, dim=0)[:out_f]
    s = _expand_cols(s, b1, in_f)
    return (w.to(torch.float32) * s).to(dtype)


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `w` [out, in] to float8_e4m3fn with one fp32 scale per block.

    `scale_inv = max|block| / 448` so the block's largest value lands on the largest fp8 value;
    all-zero blocks get scale 1.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block expects a 2-D weight, got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    b0, b1 = block
    nb0, nb1 = -(-out_f // b0), -(-in_f // b1)
    w32 = w.detach().to(torch.float32)
    padded = torch.zeros(nb0 * b0, nb1 * b1, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w32
    amax = padded.view(nb0, b0, nb1, b1).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    s = _expand_cols(scale_inv.repeat_interleave(b0, dim=0)[:out_f], b1, in_f)
    w8 = (w32 / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8, scale_inv


def fp8_linear_torch(
    x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """`x [..., K]` (bf16/fp16/fp32) times the FP8 block weight `w [N, K]` (float8_e4m3fn,
    `scale_inv [ceil(N/b0), ceil(K/b1)]` fp32) -> `[..., N]` in x's dtype.

    Weight-only: the weight is dequantized (to x's dtype, the product formed in fp32) on every
    call and never kept, so the bank stays at one byte a value; the torch twin of
    `ops.quant_triton.fp8_linear_triton`.
    """
    return torch.nn.functional.linear(x, dequant_fp8_block(w, scale_inv, block, dtype=x.dtype))


def fp8_linear_bytes(M: int, N: int, K: int, act_bytes: int = 2,
                     block: tuple[int, int] = (128, 128)) -> int:
    """Bytes one `fp8_linear` moves as stored: the fp8 weight (1 B a value) and its fp32 block
    scales read once, `x [M, K]` read and `y [M, N]` written in `act_bytes` a value."""
    scales = 4 * -(-N // block[0]) * -(-K // block[1])
    return N * K + scales + (M * K + M * N) * act_bytes
