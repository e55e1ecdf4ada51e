"""Frozen configuration dataclasses, parsed from checkpoint `config.json` files and validated."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# Step modes: a DDTree, the drafter's argmax chain, or plain one-token decoding.
MODES = ("tree", "chain", "ar")


def add_model_args(ap: argparse.ArgumentParser, budget_policy: bool = True) -> None:
    """The model-pair and step-mode flags every command line shares (generate, serve, profile)."""
    ap.add_argument("--model", help="target checkpoint dir (default: the bundled model)")
    ap.add_argument("--draft", help="DFlash drafter dir (default: the bundled drafter when "
                                    "--model is not given; needed unless --mode ar)")
    ap.add_argument("--mode", choices=MODES, default="tree")
    ap.add_argument("--budget", type=int, default=16, help="tree nodes besides the root")
    if budget_policy:
        ap.add_argument("--budget-policy", default=None,
                        help="TOML table of tree budget per batch size (configs/budgets.toml)")


TARGET_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
WRAPPED_MODEL_TYPES = ("kimi_k25",)


class ConfigError(ValueError):
    """A config file or value the engine cannot use; the message names the file and field."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from e


def _rope_fields(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Accept both `rope_scaling`/`type` and `rope_parameters`/`rope_type` spellings.

    Returns (rope_theta, scaling) where scaling is None for plain RoPE, else a dict with
    `type` ("yarn" or "linear"), `factor` and the yarn fields.
    """
    theta = d.get("rope_theta")
    raw = d.get("rope_scaling") or d.get("rope_parameters")
    if raw is not None:
        raw = dict(raw)
        theta = raw.pop("rope_theta", theta)
        kind = raw.pop("type", None) or raw.pop("rope_type", None) or "default"
        raw.pop("rope_type", None)
        if kind == "default":
            raw = None
        else:
            raw["type"] = kind
    return float(theta if theta is not None else 10000.0), raw


@dataclass(frozen=True)
class Quantization:
    """How routed-expert (INT4) or all linear (FP8) weights are stored on disk."""

    method: str  # "fp8" or "int4"
    group_size: int = 32  # int4
    block_size: tuple[int, int] = (128, 128)  # fp8
    ignore: tuple[str, ...] = ()

    @staticmethod
    def parse(q: dict[str, Any] | None, where: str) -> Quantization | None:
        if not q:
            return None
        method = q.get("quant_method")
        if method == "fp8":
            bs = tuple(q.get("weight_block_size") or (128, 128))
            return Quantization("fp8", block_size=(int(bs[0]), int(bs[1])))
        if method == "compressed-tensors":
            fmt = q.get("format")
            if fmt != "pack-quantized":
                raise ConfigError(f"{where}: unsupported compressed-tensors format {fmt!r}")
            groups = q.get("config_groups") or {}
            w = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
            bits, gs = w.get("num_bits", 4), w.get("group_size", 32)
            if bits != 4 or not w.get("symmetric", True):
                raise ConfigError(f"{where}: only symmetric 4-bit pack-quantized is supported")
            return Quantization("int4", group_size=int(gs), ignore=tuple(q.get("ignore") or ()))
        raise ConfigError(f"{where}: unsupported quantization method {method!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The target model (DeepSeek-V3 architecture), from `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "deepseek_v3"
    # Where the text model's tensors live in the checkpoint ("" or "language_model.").
    weight_prefix: str = ""
    quantization: Quantization | None = None
    source: str = field(default="", compare=False)

    # ---- parsing ---------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(f"{path}: model directory not found")
        return cls.from_dict(_read_json(path / "config.json"), source=str(path / "config.json"))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> ModelConfig:
        mt = d.get("model_type")
        prefix = ""
        quant = d.get("quantization_config")
        if mt in WRAPPED_MODEL_TYPES:
            if "text_config" not in d:
                raise ConfigError(f"{source}: model_type {mt!r} needs a 'text_config' section")
            quant = quant or d["text_config"].get("quantization_config")
            d = d["text_config"]
            prefix = "language_model."
            mt_inner = d.get("model_type", "deepseek_v3")
            if mt_inner not in TARGET_MODEL_TYPES:
                raise ConfigError(f"{source}: unsupported text_config.model_type {mt_inner!r}")
        elif mt not in TARGET_MODEL_TYPES:
            raise ConfigError(
                f"{source}: unsupported model_type {mt!r} "
                f"(expected one of {TARGET_MODEL_TYPES + WRAPPED_MODEL_TYPES})"
            )
        theta, scaling = _rope_fields(d)
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in names}
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for r in required:
            if r not in kw:
                raise ConfigError(f"{source}: missing required field {r!r}")
        eos = kw.get("eos_token_id")
        if isinstance(eos, list):
            kw["eos_token_id"] = eos[0] if eos else None
        kw.setdefault("intermediate_size", 0)
        kw.setdefault("q_lora_rank", None)
        kw.update(
            rope_theta=theta,
            rope_scaling=scaling,
            model_type=mt,
            weight_prefix=prefix,
            quantization=Quantization.parse(quant, source),
            source=source,
        )
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{self.source}: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if int(getattr(self, name)) <= 0:
                raise bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise bad(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts:
            if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
                raise bad(
                    f"only scoring_func='sigmoid' with topk_method='noaux_tc' is supported "
                    f"(got {self.scoring_func!r}, {self.topk_method!r})"
                )
            if self.n_routed_experts % self.n_group:
                raise bad(f"n_routed_experts {self.n_routed_experts} not divisible by "
                          f"n_group {self.n_group}")
            if not 0 < self.topk_group <= self.n_group:
                raise bad(f"topk_group must be in [1, n_group], got {self.topk_group}")
            per_group = self.n_routed_experts // self.n_group
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise bad("num_experts_per_tok exceeds the experts in the kept groups")
            if self.n_group > 1 and per_group < 2:
                raise bad("groups need at least 2 experts each (group score = sum of top-2)")
        if any(not self.is_moe(i) for i in range(self.num_hidden_layers)) and \
                self.intermediate_size <= 0:
            raise bad("dense layers need intermediate_size > 0")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type")
            if kind not in ("yarn", "linear"):
                raise bad(f"unsupported rope scaling type {kind!r} (expected 'yarn' or 'linear')")
            if float(self.rope_scaling.get("factor", 0)) <= 0:
                raise bad("rope scaling factor must be positive")

    # ---- derived -----------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Latent cache width per token per layer: c_kv plus the shared roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def yarn_mscale(self) -> float:
        """`m(f, mscale_all_dim)`: the softmax-scale correction of YaRN (1.0 without yarn)."""
        s = self.rope_scaling
        if not s or s.get("type") != "yarn":
            return 1.0
        return _yarn_m(float(s["factor"]), float(s.get("mscale_all_dim", 0) or 0))

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.yarn_mscale ** 2

    # ---- shapes --------------------------------------------------------------------------------

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the text model has, by checkpoint name (prefix included), at its
        logical (dequantized) shape."""
        p = self.weight_prefix
        H, nh = self.hidden_size, self.num_attention_heads
        out: dict[str, tuple[int, ...]] = {
            f"{p}model.embed_tokens.weight": (self.vocab_size, H),
            f"{p}model.norm.weight": (H,),
        }
        if not self.tie_word_embeddings:
            out[f"{p}lm_head.weight"] = (self.vocab_size, H)
        for i in range(self.num_hidden_layers):
            lp = f"{p}model.layers.{i}."
            out[lp + "input_layernorm.weight"] = (H,)
            out[lp + "post_attention_layernorm.weight"] = (H,)
            a = lp + "self_attn."
            if self.q_lora_rank:
                out[a + "q_a_proj.weight"] = (self.q_lora_rank, H)
                out[a + "q_a_layernorm.weight"] = (self.q_lora_rank,)
                out[a + "q_b_proj.weight"] = (nh * self.qk_head_dim, self.q_lora_rank)
            else:
                out[a + "q_proj.weight"] = (nh * self.qk_head_dim, H)
            out[a + "kv_a_proj_with_mqa.weight"] = (self.kv_cache_dim, H)
            out[a + "kv_a_layernorm.weight"] = (self.kv_lora_rank,)
            out[a + "kv_b_proj.weight"] = (
                nh * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
            out[a + "o_proj.weight"] = (H, nh * self.v_head_dim)
            m = lp + "mlp."
            if self.is_moe(i):
                E, inter = self.n_routed_experts, self.moe_intermediate_size
                out[m + "gate.weight"] = (E, H)
                out[m + "gate.e_score_correction_bias"] = (E,)
                if self.n_shared_experts:
                    Is = inter * self.n_shared_experts
                    out[m + "shared_experts.gate_proj.weight"] = (Is, H)
                    out[m + "shared_experts.up_proj.weight"] = (Is, H)
                    out[m + "shared_experts.down_proj.weight"] = (H, Is)
                for e in range(E):
                    out[m + f"experts.{e}.gate_proj.weight"] = (inter, H)
                    out[m + f"experts.{e}.up_proj.weight"] = (inter, H)
                    out[m + f"experts.{e}.down_proj.weight"] = (H, inter)
            else:
                inter = self.intermediate_size
                out[m + "gate_proj.weight"] = (inter, H)
                out[m + "up_proj.weight"] = (inter, H)
                out[m + "down_proj.weight"] = (H, inter)
        return out

    def param_count(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    def activated_param_count(self) -> int:
        """Parameters touched per token (routed experts count `num_experts_per_tok` per layer)."""
        total = 0
        for name, s in self.tensor_shapes().items():
            n = math.prod(s)
            if ".experts." in name:
                n = n * self.num_experts_per_tok / self.n_routed_experts
            total += n
        return int(total)

    def is_quantized_expert(self, name: str) -> bool:
        """Whether `name` (a linear's `.weight`) is stored INT4 under this checkpoint's scheme."""
        q = self.quantization
        if q is None or q.method != "int4":
            return False
        if ".mlp.experts." not in name:
            return False
        base = name.removesuffix(".weight")
        for ig in q.ignore:
            # compressed-tensors writes "re:<regex>" entries, matched from the start of the
            # module name; plain entries are exact names or dotted suffixes ("lm_head").
            if ig.startswith("re:"):
                if re.match(ig[3:], base):
                    return False
            elif base == ig or base.endswith("." + ig) or ig == name:
                return False
        return True


def _yarn_m(scale: float, mscale: float) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy; top_k -1 (or 0) means no top-k."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= -1):
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k!r}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be a positive integer, got "
                             f"{self.max_new_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not (isinstance(self.stop, tuple) and all(isinstance(x, str) for x in self.stop)):
            raise ValueError(f"stop must be a tuple of strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def truncates(self) -> bool:
        """Keeps only part of the vocabulary: top-k, top-p, or greedy (run as top-k 1)."""
        return self.greedy or self.top_k > 0 or self.top_p < 1.0
