"""Frozen configuration: the checkpoints' `config.json` files (`ModelConfig`, `DraftConfig`),
the engine's knobs (`EngineConfig`, the one source of every command line's engine flags) and
per-request sampling (`SamplingParams`), each validated once, when it is made.

`EngineConfig` and `SamplingParams` are pydantic dataclasses: their ranges and choices are
declared on the fields, and the server's request bodies reuse the same field types.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass as checked_dataclass
from pydantic_core import ArgsKwargs

from engine.memory import CPU_MEMORY_SHARE, GPU_MEMORY_UTILIZATION, parse_size
from ops.yarn import yarn_m

# Step modes: a DDTree, the drafter's argmax chain, or plain one-token decoding.
Mode = Literal["tree", "chain", "ar"]
MODES = typing.get_args(Mode)
DEFAULT_BUDGET = 16  # tree nodes besides the root, without --budget or a budget policy
# `generate --compile auto` compiles when its prompts ask for at least this many new tokens in
# all: about what pays back compiling its steps from a warm cache on a small CPU.
COMPILE_MIN_TOKENS = 65536
DType = Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]

TARGET_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
KIMI_VOCAB = 163840
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
    `type` ("yarn" or "linear"), `factor` and the yarn fields. vLLM's `deepseek_yarn` is YaRN
    whose cos/sin amplitude is `m(f, mscale) / m(f, mscale_all_dim)` with DeepSeek's defaults
    (1 and 0): it becomes "yarn" with that `attention_factor`.
    """
    theta = d.get("rope_theta")
    raw = d.get("rope_scaling") or d.get("rope_parameters")
    if raw is not None:
        raw = dict(raw)
        theta = raw.pop("rope_theta", theta)
        kind = raw.pop("type", None) or raw.pop("rope_type", None) or "default"
        raw.pop("rope_type", None)
        if kind == "deepseek_yarn":
            f = float(raw.get("factor") or 1)
            raw.setdefault("attention_factor", yarn_m(f, float(raw.get("mscale") or 1))
                           / yarn_m(f, float(raw.get("mscale_all_dim") or 0)))
            kind = "yarn"
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
        # NOTE: imported here so that reading configs (the scheduler, the server) needs no torch.
        s = self.rope_scaling
        if not s or s.get("type") != "yarn":
            return 1.0
        return yarn_m(float(s["factor"]), float(s.get("mscale_all_dim", 0) or 0))

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.yarn_mscale ** 2

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The weight block of an FP8 block checkpoint, whose every linear but the embedding,
        the router and the LM head is stored FP8 (DeepSeek-V3's layout); None otherwise."""
        q = self.quantization
        return q.block_size if q is not None and q.method == "fp8" else None

    def expert_format(self, layer: int) -> str | None:
        """How MoE layer `layer` stores its routed experts: "int4" (pack-quantized), "fp8"
        (block) or None (as plain floats)."""
        if self.fp8_block:
            return "fp8"
        name = f"{self.weight_prefix}model.layers.{layer}.mlp.experts.0.gate_proj.weight"
        return "int4" if self.is_quantized_expert(name) else None

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


def _math_changing_fields(d: dict[str, Any]) -> list[str]:
    """Fields of a Qwen3-style drafter config that would change what the layers compute in
    ways this engine does not implement (so loading must refuse rather than compute wrongly)."""
    bad = []
    kinds = set(d.get("layer_types") or ())
    if kinds - {"full_attention"}:
        bad.append(f"layer_types {sorted(kinds - {'full_attention'})}")
    if d.get("use_sliding_window") and d.get("sliding_window"):
        bad.append(f"sliding_window {d['sliding_window']}")
    for k in ("attn_logit_softcapping", "final_logit_softcapping", "logits_scaling",
              "output_multiplier", "residual_multiplier", "embedding_multiplier",
              "attention_multiplier"):
        if d.get(k) not in (None, 1, 1.0):
            bad.append(f"{k} {d[k]}")
    for k in ("attention_bias", "mlp_bias"):
        if d.get(k):
            bad.append(k)
    if d.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {d['hidden_act']!r}")
    return bad


@dataclass(frozen=True)
class DraftConfig:
    """A DFlash drafter (z-lab's layout), from its `config.json`."""

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

    @property
    def kimi_yarn_amplitude(self) -> float | None:
        """The YaRN amplitude a Kimi drafter (Kimi's 163,840-token vocabulary, YaRN rope) runs
        with unless told otherwise: `1 + 0.1 ln(factor)` (1.4159 at factor 64), what public
        ports of Kimi-K2.5-DFlash run and report as better than 1.0. None for other drafters
        (their config's own YaRN amplitude applies)."""
        s = self.rope_scaling
        if self.vocab_size != KIMI_VOCAB or not s or s.get("type") != "yarn":
            return None
        return yarn_m(float(s.get("factor") or 1), 1.0)

    @classmethod
    def from_dir(cls, path: str | Path) -> DraftConfig:
        p = Path(path) / "config.json"
        return cls.from_dict(_read_json(p), source=str(p))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "draft config") -> DraftConfig:
        dc = d.get("dflash_config") or {}
        unsupported = _math_changing_fields(d)
        if unsupported:
            raise ConfigError(f"{source}: fields that change the drafter's math and are not "
                              f"supported: {', '.join(unsupported)}")
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
                block_size=int(dc.get("block_size") or d["block_size"]),
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


# ---- request and engine knobs ------------------------------------------------------------------
# Field types the server's request bodies reuse, so a range is declared once.
# NOTE: every value here reaches a step buffer (temperature, top_p: float32; top_k: int64), so
# each range keeps it representable there: finite, within float32, within int64.
Temperature = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=2**63 - 1)]
# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): dividing logits by less
# overflows float32 into inf and NaN.
SAMPLING_EPS = 1e-5
MAX_SEED = 2**64 - 1
Seed = Annotated[int, Field(ge=-(2**63), le=MAX_SEED)]  # what a 64-bit seed holds
StopString = Annotated[str, Field(min_length=1)]
# OpenAI's bounds: at most 300 biased tokens, each by -100 to 100; at most 20 top log-probs.
MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = 20
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
LogitBias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
_STRICT = ConfigDict(strict=True)
_NO_FLAG = {"cli": False}  # a field `add_cli_args` makes no flag of
_AS_TUPLE = BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)  # TOML arrays
# A memory size as given (`16GB`, `8GiB`, bytes), checked here and read by `engine.memory`.
MemorySize = Annotated[
    str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v),
    AfterValidator(lambda v: (parse_size(v), v)[1])]


# A stop string alone, or stop strings in a list, as vLLM takes them; bias as vLLM's dict too.
_STOPS = BeforeValidator(lambda v: (v,) if isinstance(v, str) else tuple(v)
                         if isinstance(v, list) else v)
_BIAS = BeforeValidator(lambda v: tuple(sorted(v.items())) if isinstance(v, dict) else tuple(
    tuple(p) if isinstance(p, list) else p for p in v) if isinstance(v, list) else v)


def _unset(v: Any) -> bool:
    return v is None or (isinstance(v, (list, tuple, dict)) and not v)


@dataclass(frozen=True)
class VLLMNames:
    """The keyword arguments a class takes beyond its fields, so that vLLM's code ports by
    changing its import: vLLM's names of the same knobs (`aliases`, with how a value reads
    here), and vLLM's knobs this engine does not implement (`neutral`: accepted at the value
    that changes nothing, refused at any other with why). Any other name is refused with a
    TypeError naming it, and the closest known name when one is close."""

    owner: str
    aliases: Mapping[str, tuple[str, Callable[[Any], Any]]]
    neutral: Mapping[str, tuple[Callable[[Any], bool], str]]

    def canonical(self, kwargs: Mapping[str, Any], fields: Any, others: tuple[str, ...] = (),
                  owner: str | None = None) -> dict[str, Any]:
        """`kwargs` in this engine's names (`fields` and `others` are its own)."""
        owner = owner or self.owner
        out: dict[str, Any] = {}
        for k, v in kwargs.items():
            if k in fields or k in others:
                out[k] = v
            elif k in self.aliases:
                ours, read = self.aliases[k]
                if ours in kwargs:
                    raise TypeError(f"{owner}() got both {k!r} (vLLM's name) and {ours!r} (this "
                                    f"engine's) for the same knob: give one")
                out[ours] = read(v)
            elif k in self.neutral:
                unchanged, why = self.neutral[k]
                if not unchanged(v):
                    raise ValueError(f"{k}={v!r} is not supported: {why}")
            else:
                known = [*fields, *others, *self.aliases, *self.neutral]
                close = difflib.get_close_matches(k, known, n=1, cutoff=0.7)
                hint = ""
                if close:
                    name = close[0]
                    ours = self.aliases[name][0] if name in self.aliases else None
                    hint = f"; did you mean {name}" + (f" ({ours} here)" if ours else "") + "?"
                raise TypeError(f"{owner}() got an unexpected keyword argument {k!r}{hint}")
        return out

    def before(self, cls: type, v: Any) -> Any:
        """A `model_validator(mode="before")` body for the pydantic dataclass `cls`."""
        if isinstance(v, ArgsKwargs) and v.kwargs:
            return ArgsKwargs(v.args, self.canonical(v.kwargs, cls.__pydantic_fields__))
        return v


def _same(v: Any) -> Any:
    return v


SAMPLING_NAMES = VLLMNames("SamplingParams", aliases={
    "max_tokens": ("max_new_tokens", _same),
}, neutral={
    "presence_penalty": (lambda v: v == 0, "no penalties here (only 0)"),
    "frequency_penalty": (lambda v: v == 0, "no penalties here (only 0)"),
    "repetition_penalty": (lambda v: v == 1, "no penalties here (only 1)"),
    "min_p": (lambda v: v == 0, "no min-p here (only 0): use top_p or top_k"),
    "min_tokens": (lambda v: v == 0, "only 0 (use ignore_eos to run to max_tokens)"),
    "stop_token_ids": (_unset, "the model's own end-of-sequence ids stop every request; use "
                               "stop strings"),
    "bad_words": (_unset, "use logit_bias"),
    "allowed_token_ids": (_unset, "use logit_bias or a grammar"),
    "best_of": (lambda v: v in (None, 1), "every choice is returned: use n"),
    "include_stop_str_in_output": (lambda v: v is False, "the stop string is always cut"),
    "skip_special_tokens": (lambda v: v is True, "special tokens never reach the text"),
    "spaces_between_special_tokens": (lambda v: v is True, "special tokens leave no text"),
    "detokenize": (lambda v: v is True, "the text is always decoded"),
    "truncate_prompt_tokens": (_unset, "a prompt is never cut"),
    "logits_processors": (_unset, "use logit_bias or a grammar"),
    "structured_outputs": (_unset, "give an llguidance grammar as grammar"),
    "guided_decoding": (_unset, "give an llguidance grammar as grammar"),
    "extra_args": (_unset, "no extensions"),
})


@checked_dataclass(frozen=True, config=_STRICT)
class SamplingParams:
    """Per-request sampling. temperature 0 (or below SAMPLING_EPS) means greedy; top_k -1 (or 0,
    or at least the vocabulary) means no top-k. vLLM's names are taken too (`SAMPLING_NAMES`:
    `max_tokens`; its knobs not implemented here at their neutral values); any other argument
    raises a TypeError naming it. `stop` takes a string or a list."""

    temperature: Temperature = Field(0.0, description="0: greedy")
    top_p: TopP = Field(1.0, description="nucleus mass kept (1: off)")
    top_k: TopK = Field(-1, description="most likely tokens kept (-1: off)")
    max_new_tokens: Annotated[int, Field(ge=1)] = Field(64, description="tokens to generate")
    seed: Seed | None = Field(None, description="seed of the request's coins")
    ignore_eos: bool = Field(False, description="keep going past end-of-sequence tokens")
    stop: Annotated[tuple[StopString, ...], _STOPS] = Field((), description="stop strings")
    # Not flags of `engine.generate`: set by the server or the Python API.
    logit_bias: Annotated[tuple[tuple[TokenId, LogitBias], ...], _BIAS,
                          Field(max_length=MAX_LOGIT_BIAS)] = Field(
        (), description="(token id, bias) pairs: the bias is added to the token's logit before "
                        "each token is chosen, greedy or sampled", json_schema_extra=_NO_FLAG)
    logprobs: TopLogprobs | None = Field(
        None, description="report each new token's log-probability and those of this many most "
                          "likely tokens (None: none)", json_schema_extra=_NO_FLAG)
    prompt_logprobs: TopLogprobs | None = Field(
        None, description="report the prompt tokens' log-probabilities too, with this many "
                          "most likely tokens' (None: none)", json_schema_extra=_NO_FLAG)
    grammar: str | None = Field(
        None, description="an llguidance grammar (Lark text, or its JSON form: "
                          "`engine.grammar`) every output must match", json_schema_extra=_NO_FLAG)
    cache_salt: str | None = Field(
        None, description="enters the prefix cache's key of the request's first page: only "
                          "requests with the same salt share cached prefixes (vLLM's field; set "
                          "it at the trust boundary, per tenant)", json_schema_extra=_NO_FLAG)
    n: Annotated[int, Field(ge=1)] = Field(
        1, description="choices per prompt (`engine.llm.LLM.generate`: choice i samples with "
                       "seed + i)", json_schema_extra=_NO_FLAG)

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, v: Any) -> Any:
        return SAMPLING_NAMES.before(cls, v)

    @field_validator("logit_bias")
    @classmethod
    def _one_bias_per_token(cls, v: tuple[tuple[int, float], ...]
                            ) -> tuple[tuple[int, float], ...]:
        ids = [t for t, _ in v]
        if len(set(ids)) != len(ids):
            raise ValueError("a token id is biased twice")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: seed + i (vLLM's rule), wrapping past the largest seed to 0; None
    (no seed) stays None: each choice then draws its own random seed."""
    if seed is None:
        return None
    return seed + i if seed + i <= MAX_SEED else seed + i - MAX_SEED - 1


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the target (the log-softmax of its logits, before the
    temperature, the bias and top-k / top-p, as vLLM reports by default; a grammar's mask
    applied), and the most likely tokens' there, most likely first, as many as the request
    asked. Tokens a grammar rules out are at MIN_LOGPROB."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def pages_needed(num_tokens: int, page_size: int) -> int:
    """KV pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


ENGINE_NAMES = VLLMNames("EngineConfig", aliases={
    "max_num_seqs": ("max_batch_size", _same),
    "tensor_parallel_size": ("tp", _same),
    "block_size": ("page_size", _same),
    "num_gpu_blocks_override": ("kv_pages", _same),
    "enforce_eager": ("use_graphs", lambda v: False if v is True else None),
}, neutral={
    "trust_remote_code": (lambda v: isinstance(v, bool), "a bool (no remote code runs here)"),
    "tokenizer": (_unset, "the model directory's tokenizer is used"),
    "pipeline_parallel_size": (lambda v: v == 1, "only tensor parallelism (tensor_parallel_size)"),
    "data_parallel_size": (lambda v: v == 1, "run one engine per replica"),
    "quantization": (_unset, "the checkpoint's config.json says how its weights are stored"),
    "kv_cache_dtype": (lambda v: v == "auto", "the cache takes the model's dtype"),
    "seed": (_unset, "this engine has no global seed: give SamplingParams(seed=...)"),
})


@checked_dataclass(frozen=True, config=_STRICT)
class EngineConfig:
    """Every engine knob, validated once. `add_cli_args` turns these fields into the flags of
    `engine.generate`, `engine.serve` and `graphs.profile`, so all three share names, help and
    defaults. vLLM's names are taken too (`ENGINE_NAMES`: `max_num_seqs`,
    `tensor_parallel_size`, ...); any other argument raises a TypeError naming it."""

    model: str | None = Field(None, description="target checkpoint dir (default: the bundled "
                                                "model)")
    draft: str | None = Field(None, description="DFlash drafter dir (default: the bundled "
                                                "drafter when --model is not given; needed "
                                                "unless --mode ar)")
    mode: Mode = Field(
        "tree", description="a DDTree, the drafter's argmax chain, or plain decoding")
    budget: Annotated[int, Field(ge=0)] | None = Field(
        None, description="tree nodes besides the root at every batch size, 0: plain decoding "
                          "(default: the budget policy, else 16)")
    budget_policy: str | None = Field(
        None, description="TOML tables of the tree budget per batch size, greedy and sampled "
                          "(default: configs/budgets-<device>[-compiled].toml, the table of the "
                          "step's device and execution path)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when "
                                                                       "present, else the CPU")
    dtype: DType = Field(
        "auto", description="auto: bfloat16 on CUDA, float32 on the CPU")
    max_batch_size: Annotated[int, Field(ge=1)] = Field(8, description="requests per step")
    page_size: Annotated[int, Field(ge=1)] = Field(16, description="tokens per KV page")
    max_model_len: Annotated[int, Field(ge=2)] | None = Field(
        None, description="context limit (default: the model's max_position_embeddings)")
    kv_pages: Annotated[int, Field(ge=2)] | None = Field(
        None, description="KV pool pages (default: what the memory left after the weights "
                          "holds, see --gpu-memory-utilization and --cpu-memory-budget, at most "
                          "every batch slot at full context)")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = Field(
        GPU_MEMORY_UTILIZATION, description="share of the GPU's memory the engine may take "
                                            "(weights, KV pool, activations): sizes the KV "
                                            "pool unless --kv-pages")
    cpu_memory_budget: MemorySize | None = Field(
        None, description=f"memory the engine may take on the CPU (16GB, 8GiB or bytes): "
                          f"sizes the KV pool unless --kv-pages (default: "
                          f"{CPU_MEMORY_SHARE} x MemAvailable at start)")
    prefill_chunk: Annotated[int, Field(ge=1)] | None = Field(
        None, description="most prompt tokens prefilled in one engine step: a longer prompt "
                          "is prefilled in chunks of it, between the running requests' steps "
                          "(default: 2048 on the CPU, 4096 on CUDA)")
    capture_sizes: Annotated[tuple[Annotated[int, Field(ge=1)], ...], _AS_TUPLE] | None = Field(
        None, description="batch sizes with a step graph, comma-separated (default: 1, 2, "
                          "4, 8, 16, 24, 32, 48, ... up to --max-batch-size)")
    attention: Literal["auto", "flashinfer", "triton", "torch"] = Field(
        "auto", description="how attention reads the paged caches: flashinfer (its MLA prefix "
                            "kernel), triton (paged kernels whose work follows each row's "
                            "length), torch (gathered slots); auto: flashinfer where its "
                            "constraints hold, else triton, on CUDA; torch on the CPU")
    tp: Annotated[int, Field(ge=1)] = Field(1, description="tensor-parallel ranks: run under "
                                                           "torchrun --nproc-per-node N")
    draft_rope_amplitude: Annotated[float, Field(gt=0)] | None = Field(
        None, description="the drafter's YaRN cos/sin amplitude (default: the drafter config's "
                          "rope_amplitude, else 1 + 0.1 ln(factor) for Kimi drafters, else its "
                          "YaRN fields')")
    tp_timeout: Annotated[float, Field(gt=0)] = Field(
        30.0, description="seconds without a heartbeat from a peer rank before exiting")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile the step on the CPU, one graph per batch size and "
                            "step kind, compiled before the first request (inductor's cache: "
                            "~/.cache/kimi-spec); auto: off for serve (on compiles its steps at "
                            f"start), on for generate when its prompts ask for at least "
                            f"{COMPILE_MIN_TOKENS:,} new tokens, off elsewhere; CUDA "
                            f"captures graphs instead")
    enable_prefix_caching: bool = Field(
        True, description="keep prompts' and answers' whole KV pages for later requests with "
                          "the same prefix (an agent's next turn prefills only its new tokens)")
    # Not a flag: None lets the runner use CUDA graphs exactly when the device is CUDA.
    use_graphs: bool | None = Field(None, json_schema_extra={"cli": False})

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, v: Any) -> Any:
        return ENGINE_NAMES.before(cls, v)

    @model_validator(mode="after")
    def _one_budget_source(self) -> EngineConfig:
        if self.budget is not None and self.budget_policy is not None:
            raise ValueError("give budget (one budget everywhere) or budget_policy (a table per "
                             "batch size), not both")
        return self


def _flag_type(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """argparse `type` and extra keywords for a field annotation (Optional, Literal, tuples)."""
    hint = annotation
    if typing.get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    while typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) is Literal:
        return str, {"choices": typing.get_args(hint)}
    if typing.get_origin(hint) is tuple:
        return _int_tuple, {}
    return hint, {}


def int_list(low: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each >= `low`, sorted and deduplicated."""
    def parse(s: str) -> list[int]:
        try:
            out = sorted({int(x) for x in s.split(",") if x.strip()})
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e
        if not out or out[0] < low:
            raise argparse.ArgumentTypeError(f"expected integers >= {low}, got {s!r}")
        return out
    return parse


def _int_tuple(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e


def add_cli_args(ap: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
    """One flag per field of a pydantic dataclass (`EngineConfig`, `SamplingParams`): its name,
    type, choices, default and help."""
    for name, f in cls.__pydantic_fields__.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if name in exclude or extra.get("cli") is False:
            continue
        flag = "--" + name.replace("_", "-")
        if f.annotation is bool:  # --x / --no-x when on by default (vLLM's spelling)
            on = f.default is True
            ap.add_argument(flag, action=argparse.BooleanOptionalAction if on else "store_true",
                            default=f.default,
                            help=f.description + (" (default: on)" if on else ""))
            continue
        typ, kw = _flag_type(f.annotation)
        default = f.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_ = f.description if default is None else f"{f.description} (default: {shown})"
        ap.add_argument(flag, type=typ, default=default, help=help_, **kw)


def from_cli(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """`cls` from the flags `add_cli_args` made (and `overrides`); a bad value raises
    pydantic's ValidationError (a ValueError) naming the field."""
    kw = {n: getattr(args, n) for n in cls.__pydantic_fields__ if hasattr(args, n)}
    return cls(**{**kw, **overrides})


def parse_cli(parser: argparse.ArgumentParser, argv: list[str] | None, *classes: type
              ) -> tuple[Any, ...]:
    """The parsed flags, then each of `classes` built from them; a bad value exits as argparse
    does for a bad flag (status 2, the usage, and the field's problem)."""
    args = parser.parse_args(argv)
    try:
        return (args, *[from_cli(c, args) for c in classes])
    except ValidationError as e:
        parser.error(error_text(e))


def error_text(e: ValidationError) -> str:
    """The first problem pydantic found, as `field: message` (see `error_parts`)."""
    return error_parts(e)[1]


def error_parts(e: ValidationError) -> tuple[Any, str]:
    """The problem to report of those pydantic found (unknown fields first: they usually
    explain the other errors, a misspelt name), and its text."""
    errs = e.errors()
    err = next((x for x in errs if x["type"] == "extra_forbidden"), errs[0])
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return err, f"unknown field {loc!r}"
    if err["type"] == "json_invalid":
        return err, (f"invalid JSON ({err['ctx'].get('error', err['msg'])})"
                     if err.get("ctx") else "invalid JSON")
    msg = err["msg"].removeprefix("Value error, ")
    return err, f"{loc}: {msg}" if loc else msg
