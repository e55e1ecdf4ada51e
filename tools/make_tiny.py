"""Write a small random Kimi-architecture checkpoint in the real on-disk layout.

    python -m tools.make_tiny --out DIR [--seed S] [--layers N] [--hidden H] [--vocab V]
        [--experts E] [--experts-per-tok K] [--n-group G --topk-group TG] [--first-dense F]
        [--no-yarn] [--int4-experts] [--fp8] [--shards N] [--dtype bf16|fp32] [--vision]

The directory holds `config.json` (model_type `deepseek_v3`, loadable by transformers'
`DeepseekV3ForCausalLM` unchanged when not quantized), safetensors shards with the real tensor names
(plus `model.safetensors.index.json` when sharded), and Kimi-format tokenizer files.

With `--vision` it is a K2.5 instead: model_type `kimi_k25`, the text model under `text_config`
and `language_model.`, and a tiny random vision tower and projector (`vision_tower.*`,
`mm_projector.*`) whose `vision_config` carries Moonshot's keys (`vt_hidden_size`, ...) and
transformers' spellings of the same values, so transformers'
`Kimi_K25ForConditionalGeneration` loads it too.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.models.kimi import KimiForCausalLM
from engine.models.vision import KimiVision, VisionConfig
from engine.tokenizer import CHAT_TEMPLATE, CONFIG_FILE, write_tokenizer_files
from ops.quant import pack_int4, quantize_fp8_block

# Kimi reserves 256 special ids right after the ordinary ranks ([BOS] first, [PAD] last).
NUM_SPECIAL = 256
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
INT4_GROUP = 32
FP8_BLOCK = (128, 128)
# Kimi's media specials, by offset from the first special id (163602..163605 in K2.5).
MEDIA_SPECIALS = {18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
                  21: "<|media_pad|>"}
# The fallback chat template plus K2.5's rendering of an image part (`<|media_pad|>` is the one
# placeholder the engine expands to the image's tokens).
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ part['text'] }}",
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>{{ '\\n' }}"
    "{%- else -%}{{ part['text'] }}{%- endif -%}")


# ---- config ------------------------------------------------------------------------------------


def tiny_config(
    *,
    layers: int = 2,
    hidden: int = 64,
    vocab: int = 1024,
    experts: int = 8,
    experts_per_tok: int = 2,
    n_group: int = 1,
    topk_group: int = 1,
    first_dense: int = 1,
    yarn: bool = True,
    dtype: str = "bf16",
    **overrides: Any,
) -> dict[str, Any]:
    """A DeepSeek-V3 `config.json` dict with Kimi's choices (sigmoid/noaux_tc routing, one shared
    expert, interleaved YaRN RoPE with unit mscale) at toy sizes; `overrides` win."""
    if vocab < 2 * NUM_SPECIAL:
        raise ValueError(f"vocab must be >= {2 * NUM_SPECIAL} (256 byte tokens + 256 specials), "
                         f"got {vocab}")
    if hidden % 16:
        raise ValueError(f"hidden must be a multiple of 16, got {hidden}")
    n_ordinary = vocab - NUM_SPECIAL
    heads = max(1, hidden // 16)
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        # MLA has no KV heads; transformers still wants the field and expands K/V to every head.
        "num_key_value_heads": heads,
        "n_shared_experts": 1 if experts else 0,
        "n_routed_experts": experts,
        "num_experts_per_tok": experts_per_tok if experts else 0,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        # transformers makes every layer from first_k_dense_replace on MoE; keep freq 1 to agree.
        "moe_layer_freq": 1,
        "first_k_dense_replace": first_dense if experts else layers,
        "q_lora_rank": hidden // 2,
        "kv_lora_rank": hidden // 2,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 8192 if yarn else 2048,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        # Kimi ships no MTP layers; with the default (1) transformers would expect them.
        "num_nextn_predict_layers": 0,
        "bos_token_id": n_ordinary,
        "eos_token_id": n_ordinary + 1,
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype],
    }
    if yarn:
        # K2's values (factor 32, beta 1/1, mscale 1/1) over a short original context so the
        # ramp actually mixes interpolated and extrapolated frequencies at rope dim 8.
        cfg["rope_scaling"] = {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    else:
        cfg["rope_scaling"] = None
    cfg.update(overrides)
    return cfg


def tiny_vision_config(
    text: dict[str, Any], *, hidden: int = 64, heads: int = 4, layers: int = 2,
    intermediate: int = 96, pos_emb: int = 8,
) -> dict[str, Any]:
    """A K2.5 `config.json` dict around the text config `text`: Moonshot's wrapper
    (`kimi_k25`, `media_placeholder_token_id`) and a tiny `vision_config` in Moonshot's keys,
    with transformers' names of the same values beside them (its config reads only those)."""
    n_ordinary = text["vocab_size"] - NUM_SPECIAL
    # Kimi's media specials sit 18..21 after the first special id (163602..163605).
    media_pad = n_ordinary + 21
    vision = {
        "model_type": "kimi_k25_vision",
        "patch_size": 14,
        "init_pos_emb_height": pos_emb,
        "init_pos_emb_width": pos_emb,
        "init_pos_emb_time": 4,
        "merge_kernel_size": [2, 2],
        "vt_hidden_size": hidden,
        "vt_num_attention_heads": heads,
        "vt_num_hidden_layers": layers,
        "vt_intermediate_size": intermediate,
        "mm_hidden_size": hidden,
        "mm_projector_type": "patchmerger",
        "text_hidden_size": text["hidden_size"],
        # transformers' Kimi_K25VisionConfig spellings:
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "pos_emb_height": pos_emb,
        "pos_emb_width": pos_emb,
        "pos_emb_time": 4,
        "hidden_act": "gelu_pytorch_tanh",
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "media_placeholder_token_id": media_pad,
        "image_token_id": media_pad,
        "vision_start_token_id": n_ordinary + 18,
        "vision_end_token_id": n_ordinary + 20,
        "projection_hidden_size": hidden,
        "tie_word_embeddings": False,
        "torch_dtype": text["torch_dtype"],
        "text_config": text,
        "vision_config": vision,
    }


# ---- weights -----------------------------------------------------------------------------------


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 random weights for every tensor of `cfg`, keyed by checkpoint name.

    Scales keep activations O(1) through the residual stream and give logits with std about 2,
    so greedy argmax gaps are clear and outputs differ from token to token: embeddings N(0, 1),
    linears N(0, 1/in), lm_head N(0, 4/H), norms 1 + N(0, 0.05^2), router bias N(0, 0.05^2).
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    with torch.device("meta"):
        names = KimiForCausalLM(cfg).checkpoint_tensors()
    # NOTE: the order tiny checkpoints have always been drawn in (the same seed gives the same
    # tensors): embeddings, final norm and head first, then layer by layer, experts last.
    order = sorted(names, key=lambda n: (".layers." in n, _layer_of(n), ".experts." in n))
    for name in order:
        shape = names[name].shape
        name = cfg.weight_prefix + name
        if name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t = 0.05 * torch.randn(shape, generator=g)
        elif len(shape) == 1:
            t = 1.0 + 0.05 * torch.randn(shape, generator=g)
        elif name.endswith("lm_head.weight"):
            t = torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[1]))
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        out[name] = t
    return out


def random_vision_state_dict(config_dict: dict[str, Any], seed: int = 0
                             ) -> dict[str, torch.Tensor]:
    """fp32 random tower and projector weights by checkpoint name: linears and the patch conv
    N(0, 1/in), biases N(0, 0.02^2), norms 1 + N(0, 0.05^2) with biases N(0, 0.05^2), the
    position table N(0, 0.5^2) (so its resampling shows in the output)."""
    vcfg = VisionConfig.from_dict(config_dict)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.device("meta"):
        names = KimiVision(vcfg).checkpoint_tensors()
    out: dict[str, torch.Tensor] = {}
    for name, s in names.items():
        shape = s.shape
        if name.endswith("pos_emb.weight"):
            t = 0.5 * torch.randn(shape, generator=g)
        elif "norm" in name:
            base = 1.0 if name.endswith(".weight") else 0.0
            t = base + 0.05 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        else:
            fan_in = math.prod(shape[1:])
            t = torch.randn(shape, generator=g) / math.sqrt(fan_in)
        out[name] = t
    return out


def _layer_of(name: str) -> int:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _is_int4_target(name: str, t: torch.Tensor) -> bool:
    return ".mlp.experts." in name and name.endswith(".weight") and t.dim() == 2


def _is_fp8_target(name: str, t: torch.Tensor) -> bool:
    # DeepSeek-V3 FP8 layout: every linear except the embedding, the router and lm_head.
    return (
        name.endswith(".weight")
        and t.dim() == 2
        and not name.endswith("embed_tokens.weight")
        and not name.endswith("lm_head.weight")
        and not name.endswith(".mlp.gate.weight")
    )


def _int4_quant_config(names: Iterable[str]) -> dict[str, Any]:
    ignore = sorted(
        n.removesuffix(".weight")
        for n in names
        if n.endswith(".weight") and ".mlp.experts." not in n and "norm" not in n
        and not n.endswith("embed_tokens.weight")
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": INT4_GROUP,
                    "dynamic": False,
                    "observer": "minmax",
                    "actorder": None,
                    "block_structure": None,
                    "observer_kwargs": {},
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def save_checkpoint(
    state_dict: dict[str, torch.Tensor],
    config_dict: dict[str, Any],
    out_dir: str | Path,
    shards: int = 1,
    int4_experts: bool = False,
    fp8: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write `state_dict` (checkpoint names) and `config_dict` to `out_dir` in the real layout.

    Float tensors are stored as `dtype` (router `e_score_correction_bias` stays fp32). With
    `int4_experts`, routed-expert linears become `weight_packed`/`weight_scale`/`weight_shape`
    (compressed-tensors pack-quantized, group 32); with `fp8`, linears other than the embedding,
    router and lm_head become float8_e4m3fn plus `weight_scale_inv` (block 128x128). The matching
    `quantization_config` is added to the config. One shard is written as `model.safetensors`;
    more as `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`.
    """
    if int4_experts and fp8:
        raise ValueError("int4_experts and fp8 are mutually exclusive")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_dict = dict(config_dict)

    # Each group is the set of stored tensors for one logical tensor; groups never straddle shards.
    groups: list[dict[str, torch.Tensor]] = []
    for name, t in state_dict.items():
        t = t.detach().cpu()
        if int4_experts and _is_int4_target(name, t):
            packed, scale, shape = pack_int4(t, INT4_GROUP)
            groups.append({name + "_packed": packed, name + "_scale": scale,
                           name + "_shape": shape})
        elif fp8 and _is_fp8_target(name, t):
            w8, scale_inv = quantize_fp8_block(t, FP8_BLOCK)
            groups.append({name: w8, name + "_scale_inv": scale_inv})
        elif name.endswith("e_score_correction_bias"):
            groups.append({name: t.to(torch.float32)})
        elif t.is_floating_point():
            groups.append({name: t.to(dtype)})
        else:
            groups.append({name: t})
    if shards > len(groups):
        raise ValueError(f"cannot split {len(groups)} tensors into {shards} shards")

    if int4_experts:
        config_dict["quantization_config"] = _int4_quant_config(state_dict)
    elif fp8:
        config_dict["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }

    def nbytes(grp: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in grp.values())

    total = sum(nbytes(grp) for grp in groups)
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    done, i = 0, 0
    for k, grp in enumerate(groups):
        # Move on once this shard has its share, keeping at least one group for each later shard.
        if i < shards - 1 and parts[i] and (
                done >= total * (i + 1) / shards or len(groups) - k <= shards - 1 - i):
            i += 1
        parts[i].update({n: t.contiguous() for n, t in grp.items()})
        done += nbytes(grp)

    meta = {"format": "pt"}
    if shards == 1:
        save_file(parts[0], str(out_dir / "model.safetensors"), metadata=meta)
    else:
        weight_map: dict[str, str] = {}
        for j, part in enumerate(parts):
            fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(out_dir / fname), metadata=meta)
            weight_map.update(dict.fromkeys(part, fname))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    return out_dir


# ---- tokenizer ---------------------------------------------------------------------------------


def tiny_mergeable_ranks(n_ordinary: int) -> dict[bytes, int]:
    """The 256 single bytes as ranks 0..255, then two-byte merges (common ASCII pairs first)."""
    if not 256 <= n_ordinary <= 256 + 256 * 256:
        raise ValueError(f"ordinary vocabulary must be in [256, 65792], got {n_ordinary}")
    ranks = {bytes([b]): b for b in range(256)}
    common = b" etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,\n'\"!?-:;()"
    order = list(dict.fromkeys(list(common) + list(range(256))))
    pos = {b: k for k, b in enumerate(order)}
    pairs = sorted(((a, b) for a in order for b in order),
                   key=lambda p: (pos[p[0]] + pos[p[1]], pos[p[0]]))
    for a, b in pairs[: n_ordinary - 256]:
        ranks[bytes([a, b])] = len(ranks)
    return ranks


# ---- entry points ------------------------------------------------------------------------------


def make_tiny(
    out_dir: str | Path,
    *,
    seed: int = 0,
    int4_experts: bool = False,
    fp8: bool = False,
    shards: int = 1,
    dtype: str = "bf16",
    vision: bool = False,
    **options: Any,
) -> Path:
    """Write a random tiny checkpoint to `out_dir` and return it.

    `options` go to `tiny_config` (layers, hidden, vocab, experts, experts_per_tok, n_group,
    topk_group, first_dense, yarn, and any config.json field override). With `vision`, a K2.5
    with a tiny vision tower (`tiny_vision_config`).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    config_dict = tiny_config(dtype=dtype, **options)
    if vision:
        config_dict = tiny_vision_config(config_dict)
    cfg = ModelConfig.from_dict(config_dict, source=str(out_dir / "config.json"))
    state = random_state_dict(cfg, seed)
    if vision:
        state.update(random_vision_state_dict(config_dict, seed))
    save_checkpoint(state, config_dict, out_dir, shards=shards, int4_experts=int4_experts,
                    fp8=fp8, dtype=_DTYPES[dtype])
    write_tokenizer_files(out_dir, tiny_mergeable_ranks(cfg.vocab_size - NUM_SPECIAL),
                          num_reserved_special=NUM_SPECIAL)
    if vision:
        _add_media_specials(out_dir, cfg.vocab_size - NUM_SPECIAL)
    return out_dir


def _add_media_specials(out_dir: Path, first_special: int) -> None:
    """Name the media specials in `tokenizer_config.json` and render image parts in its chat
    template, as K2.5's tokenizer files do."""
    path = out_dir / CONFIG_FILE
    tc = json.loads(path.read_text())
    for off, name in MEDIA_SPECIALS.items():
        tc["added_tokens_decoder"][str(first_special + off)]["content"] = name
    tc["chat_template"] = VISION_CHAT_TEMPLATE
    path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.make_tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64, help="hidden size (multiple of 16)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary incl. 256 specials")
    p.add_argument("--experts", type=int, default=8, help="routed experts (0: all dense)")
    p.add_argument("--experts-per-tok", type=int, default=2)
    p.add_argument("--n-group", type=int, default=1)
    p.add_argument("--topk-group", type=int, default=1)
    p.add_argument("--first-dense", type=int, default=1, help="leading dense layers")
    p.add_argument("--no-yarn", action="store_true", help="plain RoPE instead of YaRN")
    p.add_argument("--int4-experts", action="store_true", help="INT4 pack-quantized experts")
    p.add_argument("--fp8", action="store_true", help="FP8 block-quantized linears")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--vision", action="store_true",
                   help="a K2.5 with a tiny vision tower and projector (Moonshot's layout)")
    a = p.parse_args(argv)
    try:
        out = make_tiny(
            a.out, seed=a.seed, int4_experts=a.int4_experts, fp8=a.fp8, shards=a.shards,
            dtype=a.dtype, layers=a.layers, hidden=a.hidden, vocab=a.vocab, experts=a.experts,
            experts_per_tok=a.experts_per_tok, n_group=a.n_group, topk_group=a.topk_group,
            first_dense=a.first_dense, yarn=not a.no_yarn, vision=a.vision,
        )
    except ValueError as e:  # includes ConfigError for inconsistent sizes
        p.error(str(e))
    print(out)


if __name__ == "__main__":
    main()
