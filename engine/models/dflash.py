"""The DFlash block drafter (z-lab layout): a few Qwen3-style layers over `[anchor, MASK x L]`
that attend, without a mask, to projected target features of the committed context and to the
block itself. It has no embeddings or lm_head of its own: it borrows the target's.

Its cache holds, per drafter layer and per committed token, the context's K (k-normed, roped at
the token's position) and V, in the same paged slots as the target's latent cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ConfigError, _read_json, _rope_fields
from engine.models.kimi import MLP, RMSNorm
from ops.rope import apply_rope_half, rope_cos_sin, rope_frequencies

if TYPE_CHECKING:
    from engine.parallel import TensorParallel
    from engine.weights import ShardFn


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    # NOTE: some ports need the yarn cos/sin amplitude overridden to match training.
    rope_amplitude: float | None = None
    source: str = ""

    @classmethod
    def from_dir(cls, path: str | Path) -> DraftConfig:
        p = Path(path) / "config.json"
        return cls.from_dict(_read_json(p), source=str(p))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "draft config") -> DraftConfig:
        dc = d.get("dflash_config") or {}
        try:
            theta, scaling = _rope_fields(d)
            nh = int(d["num_attention_heads"])
            cfg = cls(
                hidden_size=int(d["hidden_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=nh,
                num_key_value_heads=int(d.get("num_key_value_heads") or nh),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // nh),
                intermediate_size=int(d["intermediate_size"]),
                block_size=int(d["block_size"]),
                target_layer_ids=tuple(int(x) for x in dc["target_layer_ids"]),
                mask_token_id=int(dc.get("mask_token_id", d.get("mask_token_id"))),
                vocab_size=int(d.get("vocab_size") or 0),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                rope_amplitude=d.get("rope_amplitude"),
                source=source,
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: bad value ({e})") from e
        if cfg.block_size < 2:
            raise ConfigError(f"{source}: block_size must be >= 2, got {cfg.block_size}")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads must be a multiple of "
                              f"num_key_value_heads")
        return cfg

    @property
    def kv_dim(self) -> int:
        """Drafter cache width per token per layer: K and V of all KV heads."""
        return 2 * self.num_key_value_heads * self.head_dim


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        H, hd = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(H, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """`x [..., H]` -> cache rows `[..., 2 * kvh * hd]` (roped normed K, then V)."""
        c = self.c
        k = self.k_norm(self.k_proj(x).view(*x.shape[:-1], c.num_key_value_heads, c.head_dim))
        k = apply_rope_half(k, cos, sin)
        v = self.v_proj(x)
        return torch.cat([k.flatten(-2), v], dim=-1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_kv: Tensor, ctx_valid: Tensor,
                rows: tuple[int, int] | None = None) -> Tensor:
        """`x [bs, B, H]` (the block, normed); `ctx_kv [bs, C, kv_dim]`, `ctx_valid [bs, C]`.
        Every block row is a key; `rows = (start, stop)` limits the queries (and the output) to
        those rows."""
        c = self.c
        bs, B, _ = x.shape
        a, b = rows or (0, B)
        q = self.q_norm(self.q_proj(x[:, a:b]).view(bs, b - a, c.num_attention_heads, c.head_dim))
        q = apply_rope_half(q, cos[:, a:b], sin[:, a:b])
        kv = torch.cat([ctx_kv, self.kv(x, cos, sin)], dim=1)  # [bs, C + B, kv_dim]
        half = kv.shape[-1] // 2
        k = kv[..., :half].view(bs, -1, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = kv[..., half:].view(bs, -1, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        valid = torch.cat([ctx_valid, ctx_valid.new_ones(bs, B)], dim=1)
        # NOTE: grouped-query attention without materializing repeated K/V; every row sees at
        # least the block itself, so no row is fully masked.
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=valid[:, None, None, :],
            enable_gqa=c.num_attention_heads != c.num_key_value_heads)
        return self.o_proj(o.transpose(1, 2).reshape(bs, b - a, -1))


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)


class DFlashDrafter(nn.Module):
    def __init__(self, c: DraftConfig, target_hidden: int):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(len(c.target_layer_ids) * target_hidden, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        inv_freq, amp = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling,
                                         c.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_amplitude = c.rope_amplitude if c.rope_amplitude is not None else amp

    @classmethod
    def from_dir(cls, path: str | Path, target_hidden: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, tp: TensorParallel | None = None
                 ) -> DFlashDrafter:
        """With `tp`, this rank's shard (or the whole drafter where it does not split)."""
        c = DraftConfig.from_dir(path)
        if tp is None:
            model = cls(c, target_hidden).to(device=device, dtype=dtype)
            model.load_state_dict(_read_draft_weights(Path(path), model.expected_shapes()))
        else:
            model = tp.build_drafter(cls, c, target_hidden).to(device=device, dtype=dtype)
            model.load_state_dict(_read_draft_weights(Path(path), tp.full_shapes(model),
                                                      tp.shard_fn(model)))
        model.inv_freq = model.inv_freq.float()
        return model.eval().requires_grad_(False)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}

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

    def forward(self, block_emb: Tensor, positions: Tensor, ctx_kv: Tensor, ctx_valid: Tensor,
                rows: tuple[int, int] | None = None) -> Tensor:
        """`block_emb [bs, B, H]` (target embeddings of `[anchor, MASK...]`), `positions [bs, B]`,
        `ctx_kv [layers, bs, C, kv_dim]`, `ctx_valid [bs, C]` -> normed hidden `[bs, B, H]`, or
        only block rows `rows = (start, stop)` (the last layer then computes only those; the
        others still need every row as a key)."""
        cos, sin = self._rope(positions)
        h = block_emb
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            r = rows if i == last else None
            a = layer.self_attn(layer.input_layernorm(h), cos, sin, ctx_kv[i], ctx_valid, r)
            h = (h if r is None else h[:, r[0]:r[1]]) + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def _read_draft_weights(path: Path, expected: dict[str, tuple[int, ...]],
                        shard_fn: ShardFn | None = None) -> dict[str, Tensor]:
    """The drafter's tensors, each checked against its full shape in `expected`; `shard_fn`
    (tensor parallelism) picks the piece of each that this process keeps."""
    from safetensors import SafetensorError, safe_open

    from engine.weights import WeightsError

    f = path / "model.safetensors"
    if not f.is_file():
        raise WeightsError(f"{f}: drafter weights not found")
    out = {}
    try:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            names = set(st.keys())
            for name, shape in expected.items():
                if name not in names:
                    raise WeightsError(f"{f}: drafter tensor {name!r} is missing")
                sl = st.get_slice(name)
                got = tuple(sl.get_shape())
                if got != shape:
                    raise WeightsError(f"{f}: tensor {name!r} has shape {got}, "
                                       f"the drafter config expects {shape}")
                out[name] = sl[:] if shard_fn is None else shard_fn(name, sl)
    except SafetensorError as e:
        raise WeightsError(f"{f}: cannot read safetensors file ({e})") from e
    return out
