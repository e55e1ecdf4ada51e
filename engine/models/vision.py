"""Kimi K2.5's vision tower (MoonViT, images only) and its patch-merger projector.

Module names mirror the checkpoint's tensor names (`vision_tower.*`, `mm_projector.*`), so
`engine.models.layers.checkpoint_tensors` lists them and `engine.weights.load_checkpoint` loads
them as stored; every rank holds the whole tower (471 M parameters at K2.5's size, about 1.4 %
of a tp 8 rank's weights).

An image arrives as `pixel_values [L, 3, p, p]` (its patches, row-major over its grid) with its
grid `(h, w)` in patches (`engine.media` makes both). The forward, per image:

1. each patch through a conv of kernel and stride `p` (a linear over the patch), plus the learned
   `H0 x W0` position table resampled bicubically to `(h, w)`;
2. pre-norm blocks: LayerNorm, fused `wqkv`, 2-D rotary positions on queries and keys (interleaved
   pairs: pair `2i` turns by column x theta_i, pair `2i + 1` by row x theta_i), attention among
   this image's patches only (no mask: one SDPA call per image), `wo`; LayerNorm, `fc0`,
   tanh-GELU, `fc1`; then a final LayerNorm;
3. each 2 x 2 cell of patches becomes one token of 4 members (row-major over the cells, members
   (0,0), (0,1), (1,0), (1,1));
4. the projector: a LayerNorm on each member, the four concatenated, Linear, exact GELU, Linear to
   the language model's width: `[(h / 2) * (w / 2), hidden]` per image.

Video (a time axis with temporal pooling) is not built: the serving routes refuse it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ConfigError
from engine.models.layers import Stored, cast_parameters, checkpoint_tensors
from engine.weights import checkpoint_index, load_checkpoint
from ops.rope import apply_rope_interleaved

_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class VisionConfig:
    """A checkpoint's `vision_config` (Moonshot's keys, transformers' spellings accepted)."""

    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    merge_kernel: tuple[int, int] = (2, 2)
    hidden_size: int = 1152
    num_heads: int = 16
    num_layers: int = 27
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    # The prompt's one `<|media_pad|>` per image, expanded to the image's tokens.
    placeholder_id: int = 163605
    source: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge(self) -> int:
        """Patches per merged token (4 for a 2 x 2 kernel)."""
        return self.merge_kernel[0] * self.merge_kernel[1]

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> VisionConfig | None:
        """The vision config of a whole `config.json` dict, or None when it has none."""
        v = d.get("vision_config")
        if not v:
            return None

        def pick(*keys: str, default: Any) -> Any:
            return next((v[k] for k in keys if v.get(k) is not None), default)

        text = d.get("text_config") or {}
        rope = v.get("rope_parameters") or {}
        mk = pick("merge_kernel_size", default=(2, 2))
        mk = (mk, mk) if isinstance(mk, int) else tuple(int(x) for x in mk)
        cfg = cls(
            patch_size=int(pick("patch_size", default=14)),
            pos_emb_height=int(pick("init_pos_emb_height", "pos_emb_height", default=64)),
            pos_emb_width=int(pick("init_pos_emb_width", "pos_emb_width", default=64)),
            merge_kernel=mk,
            hidden_size=int(pick("vt_hidden_size", "hidden_size", default=1152)),
            num_heads=int(pick("vt_num_attention_heads", "num_attention_heads", default=16)),
            num_layers=int(pick("vt_num_hidden_layers", "num_hidden_layers", default=27)),
            intermediate_size=int(pick("vt_intermediate_size", "intermediate_size",
                                       default=4304)),
            hidden_act=str(pick("vt_hidden_act", "hidden_act", default="gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            text_hidden_size=int(pick("text_hidden_size",
                                      default=text.get("hidden_size", 7168))),
            projector_ln_eps=float(pick("projector_ln_eps", default=1e-5)),
            placeholder_id=int(d.get("media_placeholder_token_id",
                                     d.get("image_token_id", 163605))),
            source=source,
        )
        cfg.validate(v)
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> VisionConfig | None:
        p = Path(path) / "config.json"
        return cls.from_dict(json.loads(p.read_text()), source=str(p))

    def validate(self, raw: dict[str, Any]) -> None:
        where = f"{self.source}: vision_config"
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(f"{where}: hidden size {self.hidden_size} over "
                              f"{self.num_heads} heads must give a head dim divisible by 4 "
                              f"(2-D rotary positions)")
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"{where}: unsupported activation {self.hidden_act!r} "
                              f"(expected one of {sorted(_ACTIVATIONS)})")
        proj_act = raw.get("projector_hidden_act", "gelu")
        if proj_act != "gelu":
            raise ConfigError(f"{where}: unsupported projector_hidden_act {proj_act!r}")
        for key, want in (("mm_projector_type", "patchmerger"), ("pos_emb_type", "divided_fixed"),
                          ("merge_type", "sd2_tpool")):
            if raw.get(key, want) != want:
                raise ConfigError(f"{where}: unsupported {key} {raw[key]!r} (expected {want!r})")
        mm = raw.get("mm_hidden_size", self.hidden_size)
        if mm != self.hidden_size:
            raise ConfigError(f"{where}: mm_hidden_size {mm} differs from the tower's width "
                              f"{self.hidden_size}")


def has_vision_weights(path: str | Path) -> bool:
    """Whether the checkpoint in `path` has a `vision_config` and the tower's tensors (a K2.5
    whose vision shards were left out serves text only)."""
    return (VisionConfig.from_dir(path) is not None
            and "vision_tower.patch_embed.proj.weight" in checkpoint_index(path))


def vision_weight_bytes(path: str | Path) -> int:
    """Bytes of the checkpoint's tower and projector tensors as stored (their spans in the
    safetensors headers): what every rank holds whole, not a 1/tp share."""
    by_file: dict[str, list[str]] = {}
    for name, f in checkpoint_index(path).items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            by_file.setdefault(f, []).append(name)
    total = 0
    for f, names in by_file.items():
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in names)
    return total


# ---- the tower -----------------------------------------------------------------------------------


class _PosEmb(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.pos_emb_height, c.pos_emb_width, c.hidden_size))

    def forward(self, h: int, w: int) -> Tensor:
        """The table resampled to an `h x w` grid, `[h * w, D]` row-major."""
        t = self.weight
        if (h, w) != tuple(t.shape[:2]):
            t = F.interpolate(t.permute(2, 0, 1)[None].float(), size=(h, w), mode="bicubic",
                              align_corners=False)[0].permute(1, 2, 0).to(t.dtype)
        return t.reshape(h * w, -1)


class _PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size)
        self.pos_emb = _PosEmb(c)


class _VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc1 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.approximate = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class _Block(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = c.num_heads, c.head_dim
        self.norm0 = nn.LayerNorm(c.hidden_size, eps=1e-5)
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-5)
        self.wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.wo = nn.Linear(c.hidden_size, c.hidden_size)
        self.mlp = _VisionMLP(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, lengths: list[int]) -> Tensor:
        """`x [L, D]` (every image's patches, packed), `cos/sin [L, head_dim // 2]`."""
        L = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(L, 3, self.heads, self.head_dim).unbind(1)
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        # NOTE: one SDPA call per image, with no mask: attention never crosses images, and no
        # score matrix covers more than one image's patches.
        out = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                               vi.transpose(0, 1))
            out.append(o.transpose(0, 1).reshape(-1, self.heads * self.head_dim))
        x = x + self.wo(torch.cat(out))
        return x + self.mlp(self.norm1(x))


class _Encoder(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_layers))
        self.final_layernorm = nn.LayerNorm(c.hidden_size, eps=1e-5)


class _Tower(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.patch_embed = _PatchEmbed(c)
        self.encoder = _Encoder(c)


class _Projector(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        wide = c.hidden_size * c.merge
        self.pre_norm = nn.LayerNorm(c.hidden_size, eps=c.projector_ln_eps)
        self.proj = nn.Sequential(nn.Linear(wide, wide), nn.GELU(),
                                  nn.Linear(wide, c.text_hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        """`x [N, merge, D]` -> `[N, text_hidden]`."""
        return self.proj(self.pre_norm(x).flatten(1))


def rope_2d(grids: list[tuple[int, int]], head_dim: int, theta: float, device: torch.device
            ) -> tuple[Tensor, Tensor]:
    """cos/sin `[L, head_dim // 2]` (fp32) for the patches of `grids` (row-major each): pair
    `2i` turns by the column times theta_i, pair `2i + 1` by the row times theta_i, with
    theta_i = theta^(-4i / head_dim)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32,
                                       device=device) / (head_dim // 2))
    angles = []
    for h, w in grids:
        rows = torch.arange(h, device=device).repeat_interleave(w).float()
        cols = torch.arange(w, device=device).repeat(h).float()
        a = torch.stack([cols[:, None] * inv, rows[:, None] * inv], dim=-1)  # [hw, d/4, 2]
        angles.append(a.flatten(1))
    a = torch.cat(angles)
    return a.cos(), a.sin()


class KimiVision(nn.Module):
    """The tower and the projector: pixel patches of a batch of images -> one language-model
    embedding per merged 2 x 2 cell, image by image."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.cfg = c
        self.vision_tower = _Tower(c)
        self.mm_projector = _Projector(c)

    def checkpoint_tensors(self) -> dict[str, Stored]:
        """Every tensor of the tower and projector, by checkpoint name, whole."""
        return checkpoint_tensors(self)

    @classmethod
    def from_dir(cls, path: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, progress: bool = False
                 ) -> KimiVision | None:
        """The checkpoint's tower and projector (whole, on every rank), or None when its config
        has no `vision_config`."""
        cfg = VisionConfig.from_dir(path)
        if cfg is None:
            return None
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        cast_parameters(model, dtype)
        load_checkpoint(path, model.checkpoint_tensors(), progress=progress)
        return model.eval().requires_grad_(False)

    def encode_patches(self, pixel_values: Tensor, grids: list[tuple[int, int]]) -> Tensor:
        """The tower's output `[L, D]` (after the final LayerNorm, before merging) for
        `pixel_values [L, 3, p, p]`, the patches of the images of `grids` one after another."""
        c, t = self.cfg, self.vision_tower
        lengths = [h * w for h, w in grids]
        if sum(lengths) != pixel_values.shape[0]:
            raise ValueError(f"grids {grids} hold {sum(lengths)} patches, pixel_values "
                             f"{pixel_values.shape[0]}")
        w = t.patch_embed.proj.weight
        x = t.patch_embed.proj(pixel_values.to(w.dtype)).flatten(1)
        x = x + torch.cat([t.patch_embed.pos_emb(h, w_) for h, w_ in grids])
        cos, sin = rope_2d(grids, c.head_dim, c.rope_theta, x.device)
        for blk in t.encoder.blocks:
            x = blk(x, cos, sin, lengths)
        return t.encoder.final_layernorm(x)

    def merge(self, x: Tensor, grids: list[tuple[int, int]]) -> Tensor:
        """`[L, D]` patches -> `[N, merge, D]`: each kh x kw cell's members, row-major."""
        kh, kw = self.cfg.merge_kernel
        out = []
        for xi, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            if h % kh or w % kw:
                raise ValueError(f"grid {(h, w)} is not a multiple of the merge kernel "
                                 f"{(kh, kw)}")
            xi = xi.view(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4)
            out.append(xi.reshape((h // kh) * (w // kw), kh * kw, -1))
        return torch.cat(out)

    def forward(self, pixel_values: Tensor, grids: list[tuple[int, int]]) -> list[Tensor]:
        """One `[tokens_i, text_hidden]` tensor per image of `grids`."""
        x = self.mm_projector(self.merge(self.encode_patches(pixel_values, grids), grids))
        kh, kw = self.cfg.merge_kernel
        return list(x.split([(h // kh) * (w // kw) for h, w in grids]))
