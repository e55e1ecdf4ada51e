from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import ConfigError, ModelConfig, SamplingParams
from engine.models.kimi import KimiForCausalLM

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
K2_DIR = CONFIGS / "kimi-k2-instruct"
K25_DIR = CONFIGS / "kimi-k2.5-text"


def _raw(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


@pytest.fixture(scope="module")
def k2() -> ModelConfig:
    return ModelConfig.from_dir(K2_DIR)


@pytest.fixture(scope="module")
def k25() -> ModelConfig:
    return ModelConfig.from_dir(K25_DIR)


def _meta_model(cfg: ModelConfig) -> KimiForCausalLM:
    with torch.device("meta"):
        return KimiForCausalLM(cfg)


@pytest.fixture(scope="module")
def shapes(k2: ModelConfig, k25: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Every tensor name (with its prefix) and logical shape of the architecture, from the
    model built on the meta device with plain weights. ~70k entries each: built once."""
    return {k: {c.weight_prefix + n: s.shape for n, s in
                _meta_model(replace(c, quantization=None)).checkpoint_tensors().items()}
            for k, c in (("k2", k2), ("k25", k25))}


def test_quantized_checkpoints_are_listed_as_stored(k2: ModelConfig, k25: ModelConfig) -> None:
    """The K2.5 model built from its config asks for the INT4 experts as compressed-tensors
    stores them, K2's for FP8 weights with their block scales."""
    t25 = _meta_model(k25).checkpoint_tensors()
    e = "model.layers.1.mlp.experts.7."
    assert t25[e + "gate_proj.weight_packed"].shape == (2048, 7168 // 8)
    assert t25[e + "gate_proj.weight_scale"].shape == (2048, 7168 // 32)
    assert t25[e + "down_proj.weight_packed"].shape == (7168, 2048 // 8)
    assert t25[e + "down_proj.weight_shape"].value == (7168, 2048)
    assert e + "gate_proj.weight" not in t25
    assert t25["model.layers.1.self_attn.q_b_proj.weight"].dest.dtype != torch.float8_e4m3fn
    t2 = _meta_model(k2).checkpoint_tensors()
    assert t2[e + "up_proj.weight"].dest.dtype == torch.float8_e4m3fn
    assert t2[e + "up_proj.weight_scale_inv"].shape == (16, 56)
    assert t2["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].shape == (96, 12)
    # kv_b_proj is absorbed whole into every step's attention: dequantized once, at load
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.kv_b_proj.weight"):
        assert t2[name].dest.dtype != torch.float8_e4m3fn and name + "_scale_inv" not in t2


# ---- the presets parse to the published values ---------------------------------------------


def test_k2_preset_fields(k2: ModelConfig) -> None:
    assert k2.model_type == "kimi_k2"
    assert k2.weight_prefix == ""
    assert (k2.hidden_size, k2.num_hidden_layers, k2.num_attention_heads) == (7168, 61, 64)
    assert (k2.q_lora_rank, k2.kv_lora_rank) == (1536, 512)
    assert (k2.qk_nope_head_dim, k2.qk_rope_head_dim, k2.v_head_dim) == (128, 64, 128)
    assert (k2.intermediate_size, k2.moe_intermediate_size) == (18432, 2048)
    assert (k2.n_routed_experts, k2.num_experts_per_tok, k2.n_shared_experts) == (384, 8, 1)
    assert (k2.n_group, k2.topk_group, k2.norm_topk_prob) == (1, 1, True)
    assert k2.routed_scaling_factor == 2.827
    assert (k2.first_k_dense_replace, k2.moe_layer_freq) == (1, 1)
    assert (k2.vocab_size, k2.bos_token_id, k2.eos_token_id) == (163840, 163584, 163585)
    assert k2.rms_norm_eps == 1e-6
    assert k2.max_position_embeddings == 131072
    assert not k2.tie_word_embeddings
    assert k2.rope_theta == 50000.0
    assert k2.rope_scaling == {
        "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    }
    assert k2.quantization is not None
    assert (k2.quantization.method, k2.quantization.block_size) == ("fp8", (128, 128))


def test_k25_preset_fields(k2: ModelConfig, k25: ModelConfig) -> None:
    assert k25.model_type == "kimi_k25"
    assert k25.weight_prefix == "language_model."
    assert k25.rms_norm_eps == 1e-5
    assert k25.max_position_embeddings == 262144
    assert k25.rope_theta == 50000.0
    assert k25.rope_scaling is not None
    assert k25.rope_scaling["type"] == "yarn"
    assert k25.rope_scaling["factor"] == 64.0
    assert k25.rope_scaling["beta_fast"] == 32.0
    assert k25.quantization is not None
    assert (k25.quantization.method, k25.quantization.group_size) == ("int4", 32)
    assert "lm_head" in k25.quantization.ignore
    # The text model is K2's: only the fields above differ.
    same = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "intermediate_size", "moe_intermediate_size", "n_routed_experts",
            "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor", "vocab_size",
            "bos_token_id", "eos_token_id", "first_k_dense_replace", "moe_layer_freq")
    for f in same:
        assert getattr(k25, f) == getattr(k2, f), f


# ---- parameter counts ------------------------------------------------------------------------


def _k2_param_formula() -> tuple[int, int]:
    """(total, activated) for the K2 text model from its published dimensions, written out term
    by term so it checks the model's own list of tensors rather than repeating it."""
    H, V, L = 7168, 163840, 61
    nh, qr, kvr, nope, rope, vd = 64, 1536, 512, 128, 64, 128
    inter, moe_inter, E, k, shared = 18432, 2048, 384, 8, 1
    dense_layers = 1

    attn = (
        H * qr + qr  # q_a_proj + q_a_layernorm
        + qr * nh * (nope + rope)  # q_b_proj
        + H * (kvr + rope) + kvr  # kv_a_proj_with_mqa + kv_a_layernorm
        + kvr * nh * (nope + vd)  # kv_b_proj
        + nh * vd * H  # o_proj
    )
    norms = 2 * H  # input_layernorm + post_attention_layernorm
    dense_mlp = 3 * H * inter
    expert = 3 * H * moe_inter
    router = E * H + E  # gate weight + e_score_correction_bias
    shared_mlp = shared * expert
    embed_and_head = 2 * V * H + H  # untied embeddings + lm_head + final norm

    per_layer = attn + norms
    total = (embed_and_head + L * per_layer + dense_layers * dense_mlp
             + (L - dense_layers) * (router + shared_mlp + E * expert))
    activated = (embed_and_head + L * per_layer + dense_layers * dense_mlp
                 + (L - dense_layers) * (router + shared_mlp + k * expert))
    return total, activated


def test_k2_param_count_matches_formula(k2: ModelConfig) -> None:
    total, activated = _k2_param_formula()
    assert _meta_model(k2).param_counts() == (total, activated)
    assert 1.0e12 <= total <= 1.1e12
    assert 30e9 <= activated <= 34e9


def test_k25_param_count_equals_k2(k2: ModelConfig, k25: ModelConfig) -> None:
    assert _meta_model(k25).param_counts()[0] == _meta_model(k2).param_counts()[0] == \
        _k2_param_formula()[0]


# ---- tensor shapes -------------------------------------------------------------------------


def _expected_layer(prefix: str, layer: int, moe: bool) -> dict[str, tuple[int, ...]]:
    p = f"{prefix}model.layers.{layer}."
    out = {
        p + "input_layernorm.weight": (7168,),
        p + "post_attention_layernorm.weight": (7168,),
        p + "self_attn.q_a_proj.weight": (1536, 7168),
        p + "self_attn.q_a_layernorm.weight": (1536,),
        p + "self_attn.q_b_proj.weight": (64 * 192, 1536),
        p + "self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
        p + "self_attn.kv_a_layernorm.weight": (512,),
        p + "self_attn.kv_b_proj.weight": (64 * 256, 512),
        p + "self_attn.o_proj.weight": (7168, 8192),
    }
    if moe:
        out.update({
            p + "mlp.gate.weight": (384, 7168),
            p + "mlp.gate.e_score_correction_bias": (384,),
            p + "mlp.shared_experts.gate_proj.weight": (2048, 7168),
            p + "mlp.shared_experts.up_proj.weight": (2048, 7168),
            p + "mlp.shared_experts.down_proj.weight": (7168, 2048),
        })
        for e in (0, 191, 383):
            out[p + f"mlp.experts.{e}.gate_proj.weight"] = (2048, 7168)
            out[p + f"mlp.experts.{e}.up_proj.weight"] = (2048, 7168)
            out[p + f"mlp.experts.{e}.down_proj.weight"] = (7168, 2048)
    else:
        out.update({
            p + "mlp.gate_proj.weight": (18432, 7168),
            p + "mlp.up_proj.weight": (18432, 7168),
            p + "mlp.down_proj.weight": (7168, 18432),
        })
    return out


@pytest.mark.parametrize("which,prefix", [("k2", ""), ("k25", "language_model.")])
def test_layer_shapes(shapes: dict, which: str, prefix: str) -> None:
    s = shapes[which]
    for layer, moe in ((0, False), (1, True), (60, True)):
        for name, shape in _expected_layer(prefix, layer, moe).items():
            assert s.get(name) == shape, name
        lp = f"{prefix}model.layers.{layer}.mlp."
        layer_names = [n for n in s if n.startswith(lp)]
        if moe:
            assert f"{lp}gate_proj.weight" not in s
            assert sum(".experts." in n for n in layer_names) == 3 * 384
        else:
            assert f"{lp}gate.weight" not in s
            assert not any(".experts." in n for n in layer_names)
    assert s[f"{prefix}model.embed_tokens.weight"] == (163840, 7168)
    assert s[f"{prefix}lm_head.weight"] == (163840, 7168)
    assert s[f"{prefix}model.norm.weight"] == (7168,)
    assert f"{prefix}model.layers.61.input_layernorm.weight" not in s
    # Every name carries the wrapper's prefix and nothing else does.
    assert all(n.startswith(f"{prefix}model.") or n == f"{prefix}lm_head.weight" for n in s)


def test_moe_layer_pattern(k2: ModelConfig) -> None:
    assert [k2.is_moe(i) for i in range(61)] == [False] + [True] * 60


# ---- derived attention constants -----------------------------------------------------------


def test_softmax_scale_and_cache_dim(k2: ModelConfig, k25: ModelConfig) -> None:
    # 192 ** -0.5 * (0.1 * ln(factor) + 1) ** 2, with mscale_all_dim = 1.
    assert k2.softmax_scale == pytest.approx(0.1309, abs=5e-5)
    assert k25.softmax_scale == pytest.approx(0.1447, abs=5e-5)
    assert k2.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2)
    assert k2.qk_head_dim == k25.qk_head_dim == 192
    assert k2.kv_cache_dim == k25.kv_cache_dim == 576


# ---- INT4 expert detection -------------------------------------------------------------------


def test_is_quantized_expert_k25(k25: ModelConfig) -> None:
    p = "language_model.model.layers."
    for name in (f"{p}1.mlp.experts.0.gate_proj.weight", f"{p}60.mlp.experts.383.down_proj.weight",
                 f"{p}30.mlp.experts.17.up_proj.weight"):
        assert k25.is_quantized_expert(name), name
    for name in (f"{p}1.self_attn.q_a_proj.weight", f"{p}1.self_attn.kv_b_proj.weight",
                 f"{p}1.self_attn.o_proj.weight", f"{p}1.mlp.shared_experts.gate_proj.weight",
                 f"{p}1.mlp.shared_experts.down_proj.weight", f"{p}0.mlp.gate_proj.weight",
                 f"{p}0.mlp.down_proj.weight", f"{p}1.mlp.gate.weight",
                 "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"):
        assert not k25.is_quantized_expert(name), name


def test_is_quantized_expert_fp8_is_never_int4(k2: ModelConfig) -> None:
    assert not k2.is_quantized_expert("model.layers.1.mlp.experts.0.gate_proj.weight")


def test_ignore_regex_and_plain_entries_apply_to_experts() -> None:
    d = _raw(K25_DIR)
    d["quantization_config"]["ignore"] = [
        r"re:.*layers\.60\.mlp\.experts\..*",  # a regex that does cover routed experts
        "language_model.model.layers.2.mlp.experts.5.up_proj",  # an exact module name
        "layers.3.mlp.experts.0.down_proj",  # a dotted suffix
    ]
    cfg = ModelConfig.from_dict(d)
    p = "language_model.model.layers."
    assert not cfg.is_quantized_expert(f"{p}60.mlp.experts.7.gate_proj.weight")
    assert cfg.is_quantized_expert(f"{p}59.mlp.experts.7.gate_proj.weight")
    assert not cfg.is_quantized_expert(f"{p}2.mlp.experts.5.up_proj.weight")
    assert cfg.is_quantized_expert(f"{p}2.mlp.experts.5.gate_proj.weight")
    assert not cfg.is_quantized_expert(f"{p}3.mlp.experts.0.down_proj.weight")
    # A suffix match needs a whole dotted component: layers.13 is not layers.3.
    assert cfg.is_quantized_expert(f"{p}13.mlp.experts.0.down_proj.weight")


# ---- rope spellings ----------------------------------------------------------------------


def test_rope_spellings_parse_identically() -> None:
    yarn = {"factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    old = _raw(K2_DIR)
    old.update(rope_theta=50000.0, rope_scaling={"type": "yarn", **yarn})
    new = _raw(K2_DIR)
    del new["rope_scaling"], new["rope_theta"]
    new["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, **yarn}
    a, b = ModelConfig.from_dict(old), ModelConfig.from_dict(new)
    assert (a.rope_theta, a.rope_scaling) == (b.rope_theta, b.rope_scaling)
    assert a.rope_scaling == {"type": "yarn", **yarn}
    assert a.softmax_scale == b.softmax_scale
    assert a == b


def test_default_rope_type_means_no_scaling() -> None:
    d = _raw(K2_DIR)
    del d["rope_scaling"], d["rope_theta"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    cfg = ModelConfig.from_dict(d)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.yarn_mscale) == (12345.0, None, 1.0)


# ---- errors --------------------------------------------------------------------------------


def _k2_with(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(_raw(K2_DIR))
    d.update(changes)
    return d


def test_unknown_model_type() -> None:
    with pytest.raises(ConfigError, match=r"model_type 'llama'"):
        ModelConfig.from_dict(_k2_with(model_type="llama"))


def test_unknown_inner_model_type() -> None:
    d = _raw(K25_DIR)
    d["text_config"]["model_type"] = "qwen3"
    with pytest.raises(ConfigError, match=r"text_config\.model_type 'qwen3'"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("field", ["hidden_size", "kv_lora_rank", "vocab_size"])
def test_missing_required_field(field: str) -> None:
    d = _k2_with()
    del d[field]
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        ModelConfig.from_dict(d, source="k2.json")


def test_missing_field_names_the_file(tmp_path: Path) -> None:
    d = _k2_with()
    del d["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
    assert "'num_attention_heads'" in str(e.value)


def test_k25_without_text_config() -> None:
    d = _raw(K25_DIR)
    del d["text_config"]
    with pytest.raises(ConfigError, match=r"'kimi_k25'.*'text_config'"):
        ModelConfig.from_dict(d)


def test_unsupported_quantization_method() -> None:
    with pytest.raises(ConfigError, match=r"quantization method 'gptq'"):
        ModelConfig.from_dict(_k2_with(quantization_config={"quant_method": "gptq", "bits": 4}))


def test_unsupported_compressed_tensors_format() -> None:
    d = _raw(K25_DIR)
    d["quantization_config"]["format"] = "float-quantized"
    with pytest.raises(ConfigError, match=r"format 'float-quantized'"):
        ModelConfig.from_dict(d)


def test_softmax_scoring_rejected() -> None:
    with pytest.raises(ConfigError, match=r"scoring_func.*'softmax'"):
        ModelConfig.from_dict(_k2_with(scoring_func="softmax"))


def test_missing_dir_and_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(ConfigError, match="config.json: file not found"):
        ModelConfig.from_dir(tmp_path)


# ---- SamplingParams ------------------------------------------------------------------------


@pytest.mark.parametrize("kw,field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_sampling_params_invalid(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_valid_edges() -> None:
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    sp = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1)
    assert not sp.greedy
    SamplingParams(top_k=-1)


@pytest.mark.parametrize("cli", ["engine.generate", "engine.serve", "graphs.profile"])
def test_a_bad_flag_value_exits_naming_the_field(cli: str, capsys: pytest.CaptureFixture[str]
                                                 ) -> None:
    """The three CLIs check their engine flags through one `parse_cli`: argparse's exit (2),
    its usage, and the field's problem, before anything loads."""
    import importlib

    main = importlib.import_module(cli).main
    needed = ["--prompts", "p.txt", "--output", "o.jsonl"] if cli == "engine.generate" else []
    with pytest.raises(SystemExit) as e:
        main([*needed, "--tp", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err
    assert "error: tp: Input should be greater than or equal to 1" in err
