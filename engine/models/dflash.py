"""The DFlash block drafter (z-lab layout): a few Qwen3-style layers over `[anchor, MASK x L]`
that attend, without a mask, to projected target features of the committed context and to the
block itself. It has no embeddings or lm_head of its own: it borrows the target's.

Its cache holds, per drafter layer and per committed token, the context's K (k-normed, roped at
the token's position) and V, in the same paged slots as the target's latent cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import DraftConfig
from engine.dist import Group, world_of
from engine.models.layers import MLP, RMSNorm, cast_parameters, checkpoint_tensors, linear
from engine.weights import load_checkpoint
from ops.paged import ContextFn, draft_attention
from ops.rope import apply_rope_half, rope_cos_sin, rope_frequencies


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig, tp: Group | None = None):
        super().__init__()
        self.c = c
        w = world_of(tp)
        self.num_heads, self.num_kv_heads = c.num_attention_heads // w, c.num_key_value_heads // w
        H, hd = c.hidden_size, c.head_dim
        self.q_proj = linear(H, c.num_attention_heads * hd, tp, 0)
        self.k_proj = linear(H, c.num_key_value_heads * hd, tp, 0)
        self.v_proj = linear(H, c.num_key_value_heads * hd, tp, 0)
        self.o_proj = linear(c.num_attention_heads * hd, H, tp, 1)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """`x [..., H]` -> cache rows `[..., 2 * kvh * hd]` (roped normed K, then V)."""
        c = self.c
        k = self.k_norm(self.k_proj(x).view(*x.shape[:-1], self.num_kv_heads, c.head_dim))
        k = apply_rope_half(k, cos, sin)
        v = self.v_proj(x)
        return torch.cat([k.flatten(-2), v], dim=-1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_kv: Tensor | PagedContext,
                ctx_valid: Tensor | None, rows: tuple[int, int] | None = None) -> Tensor:
        """`x [bs, B, H]` (the block, normed); the committed context either gathered, `ctx_kv
        [bs, C, kv_dim]` with `ctx_valid [bs, C]`, or read in place (`PagedContext` of this
        layer). Every block row is a key; `rows = (start, stop)` limits the queries (and the
        output) to those rows."""
        c = self.c
        bs, B, _ = x.shape
        a, b = rows or (0, B)
        q = self.q_norm(self.q_proj(x[:, a:b]).view(bs, b - a, self.num_heads, c.head_dim))
        q = apply_rope_half(q, cos[:, a:b], sin[:, a:b])
        if isinstance(ctx_kv, PagedContext):
            o = draft_attention(q, self.kv(x, cos, sin), ctx_kv.cache, ctx_kv.page_table,
                                ctx_kv.ctx_len, ctx_kv.page_size, c.head_dim ** -0.5,
                                context=ctx_kv.attend)
            return self.o_proj(o.to(x.dtype).reshape(bs, b - a, -1))
        kv = torch.cat([ctx_kv, self.kv(x, cos, sin)], dim=1)  # [bs, C + B, kv_dim]
        half = kv.shape[-1] // 2
        k = kv[..., :half].view(bs, -1, self.num_kv_heads, c.head_dim).transpose(1, 2)
        v = kv[..., half:].view(bs, -1, self.num_kv_heads, c.head_dim).transpose(1, 2)
        valid = torch.cat([ctx_valid, ctx_valid.new_ones(bs, B)], dim=1)
        # NOTE: grouped-query attention without materializing repeated K/V; every row sees at
        # least the block itself, so no row is fully masked.
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=valid[:, None, None, :],
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(bs, b - a, -1))


@dataclass
class PagedContext:
    """The drafter's committed context read in place from its paged cache: `cache [layers,
    num_slots, kv_dim]` (or one layer's `[num_slots, kv_dim]`), `page_table [bs, W]`, `ctx_len
    [bs]`, and `attend`, the context attention that reads it (`ops.paged.ContextFn`: the
    attention backend's). Indexing by layer gives that layer's context."""

    cache: Tensor
    page_table: Tensor
    ctx_len: Tensor
    page_size: int
    attend: ContextFn

    def __getitem__(self, layer: int) -> PagedContext:
        return replace(self, cache=self.cache[layer])


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig, tp: Group | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c, tp)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, tp)


def splits(c: DraftConfig, tp: Group | None) -> bool:
    """Whether the drafter can be split across `tp` (heads, KV heads and intermediate size all
    divide); it is replicated otherwise."""
    return tp is not None and all(n % tp.world == 0 for n in (
        c.num_attention_heads, c.num_key_value_heads, c.intermediate_size))


class DFlashDrafter(nn.Module):
    """With `tp`, split like the target (heads, KV heads, intermediate) when `splits`, else
    whole on every rank."""

    def __init__(self, c: DraftConfig, target_hidden: int, tp: Group | None = None):
        super().__init__()
        self.c = c
        tp = tp if splits(c, tp) else None
        self.fc = linear(len(c.target_layer_ids) * target_hidden, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c, tp) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", torch.empty(c.head_dim // 2), persistent=False)
        self._init_rope()

    def _init_rope(self) -> None:
        """Frequencies in fp32 whatever the model dtype: rounded to bf16 they would be off by
        up to 0.3%, radians off at long distances."""
        c = self.c
        inv_freq, amp = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling,
                                         c.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self.rope_amplitude = next(a for a in (c.rope_amplitude, c.kimi_yarn_amplitude, amp)
                                   if a is not None)

    @property
    def kv_dim(self) -> int:
        """This rank's drafter cache width per token per layer: K and V of its KV heads."""
        return 2 * self.layers[0].self_attn.num_kv_heads * self.c.head_dim

    @classmethod
    def from_dir(cls, path: str | Path, target_hidden: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, tp: Group | None = None,
                 rope_amplitude: float | None = None) -> DFlashDrafter:
        """With `tp`, this rank's shard (or the whole drafter where it does not split);
        `rope_amplitude` overrides the YaRN cos/sin amplitude."""
        c = DraftConfig.from_dir(path)
        if rope_amplitude is not None:
            c = replace(c, rope_amplitude=rope_amplitude)
        with torch.device("meta"):
            model = cls(c, target_hidden, tp)
        model.to_empty(device=device)
        cast_parameters(model, dtype)
        load_checkpoint(path, checkpoint_tensors(model), progress=False)
        model._init_rope()
        return model.eval().requires_grad_(False)

    def save(self, out_dir: str | Path, config: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.rope_amplitude)

    def context_kv(self, features: Tensor, positions: Tensor) -> Tensor:
        """Cache rows for committed tokens: `features [..., n * H_target]` (target aux-layer
        outputs), `positions [...]` -> `[layers, ..., kv_dim]`."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self._rope(positions)
        # NOTE: context features skip each layer's input norm (they are normed once above).
        return torch.stack([layer.self_attn.kv(ctx, cos, sin) for layer in self.layers])

    def forward(self, block_emb: Tensor, positions: Tensor, ctx_kv: Tensor | PagedContext,
                ctx_valid: Tensor | None = None, rows: tuple[int, int] | None = None) -> Tensor:
        """`block_emb [bs, B, H]` (target embeddings of `[anchor, MASK...]`), `positions [bs, B]`,
        the context gathered (`ctx_kv [layers, bs, C, kv_dim]`, `ctx_valid [bs, C]`) or paged
        (`PagedContext`) -> normed hidden `[bs, B, H]`, or only block rows `rows = (start,
        stop)` (the last layer then computes only those; the others still need every row as
        a key)."""
        cos, sin = self._rope(positions)
        h = block_emb
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            r = rows if i == last else None
            a = layer.self_attn(layer.input_layernorm(h), cos, sin, ctx_kv[i], ctx_valid, r)
            h = (h if r is None else h[:, r[0]:r[1]]) + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)
