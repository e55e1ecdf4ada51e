from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import ConfigError, ModelConfig
from engine.dist import Group
from engine.models.kimi import KimiForCausalLM
from engine.weights import WeightsError, checkpoint_index
from ops.quant import dequant_fp8_block, dequant_int4
from tools.make_tiny import main as make_tiny_main
from tools.make_tiny import make_tiny, random_state_dict, save_checkpoint, tiny_config

SEED = 7


def _raw(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a checkpoint, as written."""
    out = {}
    for name, path in checkpoint_index(model_dir).items():
        with safe_open(path, framework="pt", device="cpu") as f:
            out[name] = f.get_tensor(name)
    return out


def _load(model_dir: Path, **kw) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor as the loaded model holds it, by name (without the prefix)."""
    model = KimiForCausalLM.from_dir(model_dir, progress=False, **kw)
    return {name: s.dest for name, s in model.checkpoint_tensors().items()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    out = {
        "single": make_tiny(root / "single", seed=SEED, dtype="fp32"),
        "int4": make_tiny(root / "int4", seed=SEED, dtype="fp32", int4_experts=True, shards=2),
        "fp8": make_tiny(root / "fp8", seed=SEED, dtype="fp32", fp8=True),
    }
    # The command line writes the sharded copy: same seed, so the same tensors.
    make_tiny_main(["--out", str(root / "sharded"), "--seed", str(SEED), "--dtype", "fp32",
                    "--shards", "3"])
    out["sharded"] = root / "sharded"
    return out


@pytest.fixture(scope="module")
def single_weights(ckpts: dict[str, Path]) -> dict[str, torch.Tensor]:
    return _load(ckpts["single"])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """`dst` = `src`'s config with `tensors` as its single model.safetensors."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


# ---- loading -----------------------------------------------------------------------------------


def test_single_file_matches_written_weights(ckpts, single_weights) -> None:
    cfg = ModelConfig.from_dir(ckpts["single"])
    with torch.device("meta"):
        shapes = {k: s.shape for k, s in KimiForCausalLM(cfg).checkpoint_tensors().items()}
    assert set(single_weights) == set(shapes)
    ref = random_state_dict(cfg, SEED)
    for name, t in single_weights.items():
        assert t.shape == shapes[name] and t.dtype == torch.float32, name
        assert torch.equal(t, ref[name]), name
    bias = single_weights["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0


def test_sharded_equals_single(ckpts, single_weights) -> None:
    index = json.loads((ckpts["sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (ckpts["sharded"] / "model.safetensors").exists()
    sharded = _load(ckpts["sharded"])
    assert sharded.keys() == single_weights.keys()
    for name, t in sharded.items():
        assert torch.equal(t, single_weights[name]), name


def test_dtype_conversion_keeps_the_router_fp32(ckpts, single_weights) -> None:
    w = _load(ckpts["single"], dtype=torch.bfloat16)
    assert w["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    gate = "model.layers.1.mlp.gate.weight"  # scored in fp32 each step: kept fp32, not cast
    assert w[gate].dtype == torch.float32
    assert torch.equal(w[gate], single_weights[gate].float())
    assert torch.equal(w["lm_head.weight"], single_weights["lm_head.weight"].bfloat16())


def test_int4_experts_stay_packed(ckpts, single_weights) -> None:
    """INT4 experts load as stored (int32 words, bf16 scales), nothing dequantized whole; the
    bank's per-call dequantization gives dequant_int4's weights, near the unquantized ones."""
    d = ckpts["int4"]
    cfg = ModelConfig.from_dir(d)
    assert cfg.quantization is not None and cfg.quantization.method == "int4"
    raw = _raw(d)
    model = KimiForCausalLM.from_dir(d, progress=False)
    w = {name: s.dest for name, s in model.checkpoint_tensors().items() if s.dest is not None}
    assert w.keys() == {n for n in raw if not n.endswith("_shape")}
    for name, t in w.items():
        assert t.dtype == raw[name].dtype, name  # int32 words, bf16 scales, fp32 floats
        assert torch.equal(t, raw[name]), name
    n_banks = 0
    for i, layer in enumerate(model.model.layers):
        if not cfg.is_moe(i):
            continue
        bank = layer.mlp.experts
        assert bank.fmt == "int4" and not any(p.dtype != torch.int32 for p in (
            bank.w13_packed, bank.w2_packed))
        w13, w2 = bank.weights(None, torch.float32)
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            for proj, got in (("gate_proj", w13[e, :inter]), ("up_proj", w13[e, inter:]),
                              ("down_proj", w2[e])):
                name = f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"
                want = dequant_int4(raw[name + "_packed"], raw[name + "_scale"],
                                    raw[name + "_shape"], group_size=32)
                assert torch.equal(got, want), name
                step = raw[name + "_scale"].float().amax()
                assert (got - single_weights[name]).abs().max() <= 0.51 * step, name
        n_banks += 1
    assert n_banks == sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))


def test_fp8_linears_stay_fp8(ckpts, single_weights, tmp_path) -> None:
    """FP8 block weights load as stored (float8_e4m3fn and their fp32 scales), expert banks
    too where the expert intermediate size is a whole number of blocks; everything else (the
    embedding, norms, router, lm_head) as written, and `kv_b_proj` (absorbed whole into every
    step's attention) dequantized once at load."""
    for d in (ckpts["fp8"], make_tiny(tmp_path / "fp8-128", seed=SEED, dtype="fp32", fp8=True,
                                      moe_intermediate_size=128)):
        raw = _raw(d)
        model = KimiForCausalLM.from_dir(d, progress=False)
        bank = model.model.layers[1].mlp.experts
        assert bank.fmt == ("fp8" if d.name == "fp8-128" else None)
        w = {name: s.dest for name, s in model.checkpoint_tensors().items()
             if bank.fmt or ".experts." not in name}
        for kv_b in [n for n in w if ".kv_b_proj." in n]:
            assert torch.equal(w.pop(kv_b), dequant_fp8_block(raw[kv_b], raw[kv_b + "_scale_inv"]))
        assert w.keys() == {n for n in raw if (bank.fmt or ".experts." not in n)
                            and ".kv_b_proj." not in n}
        assert "model.layers.0.self_attn.q_a_proj.weight_scale_inv" in w
        for name, t in w.items():
            assert t.dtype == raw[name].dtype, name
            assert torch.equal(t.float(), raw[name].float()), name
        if bank.fmt:
            w13, _ = bank.weights(None, torch.float32)
            name = "model.layers.1.mlp.experts.3.up_proj.weight"
            want = dequant_fp8_block(raw[name], raw[name + "_scale_inv"])
            assert torch.equal(w13[3, 128:], want)
    # the 64-wide experts cut blocks apart: that bank is plain, dequantized at load
    plain = _load(ckpts["fp8"])
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    raw = _raw(ckpts["fp8"])
    assert torch.equal(plain[name], dequant_fp8_block(raw[name], raw[name + "_scale_inv"]))
    assert torch.equal(plain["lm_head.weight"], single_weights["lm_head.weight"])


def test_kimi_k25_wrapper_skips_vision_and_extra_tensors(ckpts, single_weights, tmp_path) -> None:
    text_cfg = json.loads((ckpts["single"] / "config.json").read_text())
    n_layers = text_cfg["num_hidden_layers"]
    tensors = {"language_model." + k: v for k, v in _raw(ckpts["single"]).items()}
    extra = {
        "vision_tower.x.weight": torch.ones(3, 3),
        "mm_projector.proj.weight": torch.ones(2, 2),
        "language_model.model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
        # an MTP layer as DeepSeek-V3 ships it, and a dtype we would refuse were it used
        f"language_model.model.layers.{n_layers}.eh_proj.weight": torch.ones(2, 4),
        "vision_tower.pos.weight": torch.ones(2, dtype=torch.int16),
    }
    cfg_dict = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": text_cfg, "vision_config": {"hidden_size": 3}}
    d = save_checkpoint(tensors | extra, cfg_dict, tmp_path / "k25", shards=2,
                        dtype=torch.float32)
    cfg = ModelConfig.from_dir(d)
    assert cfg.weight_prefix == "language_model."
    w = _load(d)
    assert w.keys() == single_weights.keys()
    for name, t in w.items():
        assert torch.equal(t, single_weights[name]), name


def test_a_rank_loads_only_its_pieces(ckpts, single_weights) -> None:
    """Rank 1 of 2 holds the second half of every split tensor (rows or columns, by the
    layer's rule), the whole of every replicated one; quantized tensors alike."""
    p = "model.layers.1."
    second = [("lm_head.weight", 0), ("model.embed_tokens.weight", 0),
              (p + "self_attn.q_b_proj.weight", 0), (p + "self_attn.o_proj.weight", 1),
              (p + "mlp.experts.2.up_proj.weight", 0), (p + "mlp.experts.2.down_proj.weight", 1),
              (p + "mlp.shared_experts.gate_proj.weight", 0)]
    whole = [p + "self_attn.q_a_proj.weight", p + "self_attn.kv_a_proj_with_mqa.weight",
             p + "mlp.gate.weight", "model.norm.weight"]
    for d in (ckpts["single"], ckpts["int4"]):
        # NOTE: the tiny INT4 banks' halves would cut a scale group apart: they load dequantized
        w, full = _load(d, tp=Group(1, 2)), _logical(KimiForCausalLM.from_dir(d, progress=False))
        assert w.keys() == single_weights.keys()  # checkpoint names, no prefix
        for name, dim in second:
            n = full[name].shape[dim] // 2
            assert torch.equal(w[name], full[name].narrow(dim, n, n)), name
        for name in whole:
            assert torch.equal(w[name], full[name]), name


def _logical(model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """Every linear's float weight by checkpoint name, quantized experts dequantized."""
    out = {n: s.dest for n, s in model.checkpoint_tensors().items() if s.dest is not None}
    for i, layer in enumerate(model.model.layers):
        bank = getattr(layer.mlp, "experts", None)
        if bank is not None and bank.fmt:
            w13, w2 = bank.weights(None, torch.float32)
            for e in range(bank.num_experts):
                p = f"model.layers.{i}.mlp.experts.{e}."
                out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = w13[e].chunk(2)
                out[p + "down_proj.weight"] = w2[e]
    return out


def test_progress_bar_on_stderr(ckpts, capsys) -> None:
    KimiForCausalLM.from_dir(ckpts["single"], progress=True)
    assert "loading weights" in capsys.readouterr().err


def test_transformers_loads_checkpoint_unchanged(ckpts, single_weights) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        ckpts["single"], torch_dtype=torch.float32)
    hf = model.state_dict()
    cfg = ModelConfig.from_dir(ckpts["single"])
    inter = cfg.moe_intermediate_size
    used: set[str] = set()
    for name, t in single_weights.items():
        parts = name.split(".")
        if ".mlp.experts." in name:  # transformers fuses experts: [E, 2I, H] and [E, H, I]
            layer, e, proj = parts[2], int(parts[5]), parts[6]
            base = f"model.layers.{layer}.mlp.experts."
            if proj == "down_proj":
                key, got = base + "down_proj", hf[base + "down_proj"][e]
            else:
                key = base + "gate_up_proj"
                half = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                got = hf[key][e][half]
        else:
            key, got = name, hf[name]
        used.add(key)
        assert torch.equal(got, t), name
    assert used == set(hf)


# ---- errors ------------------------------------------------------------------------------------


def test_missing_shard_names_file(ckpts, tmp_path) -> None:
    d = _copy(ckpts["sharded"], tmp_path / "c")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"model-00002-of-00003\.safetensors.*does not exist"):
        _load(d)


@pytest.mark.parametrize("which", ["sharded", "single"])
def test_truncated_file_names_file(ckpts, tmp_path, which) -> None:
    d = _copy(ckpts[which], tmp_path / "c")
    fname = "model-00003-of-00003.safetensors" if which == "sharded" else "model.safetensors"
    data = (d / fname).read_bytes()
    (d / fname).write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=rf"{fname}: cannot read safetensors file"):
        _load(d)


def test_garbage_index_names_file(ckpts, tmp_path) -> None:
    d = _copy(ckpts["sharded"], tmp_path / "c")
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightsError, match=r"model\.safetensors\.index\.json"):
        _load(d)


def test_missing_tensor_names_tensor(ckpts, tmp_path) -> None:
    d = _copy(ckpts["sharded"], tmp_path / "c")
    idx_path = d / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    del idx["weight_map"]["model.layers.1.self_attn.o_proj.weight"]
    idx_path.write_text(json.dumps(idx))
    with pytest.raises(WeightsError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight'"):
        _load(d)


def test_missing_int4_scale_names_tensor(ckpts, tmp_path) -> None:
    raw = _raw(ckpts["int4"])
    del raw["model.layers.1.mlp.experts.0.gate_proj.weight_scale"]
    d = _rewrite(ckpts["int4"], tmp_path / "c", raw)
    with pytest.raises(WeightsError, match=r"experts\.0\.gate_proj\.weight_scale"):
        _load(d)


def test_wrong_shape_names_tensor_and_shapes(ckpts, tmp_path) -> None:
    raw = _raw(ckpts["single"])
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    rows, cols = raw[name].shape
    raw[name] = torch.zeros(rows + 1, cols)
    d = _rewrite(ckpts["single"], tmp_path / "c", raw)
    with pytest.raises(WeightsError) as ei:
        _load(d)
    msg = str(ei.value)
    assert name in msg and f"({rows + 1}, {cols})" in msg and f"({rows}, {cols})" in msg


CORRUPT_TENSOR = [
    # (checkpoint, tensor, stored key suffix, change, expected message)
    ("int4", "model.layers.1.mlp.experts.1.down_proj.weight", "_shape", lambda t: t * 2,
     r"{name}.*\(128, 64\).*\(64, 32\)"),
    ("single", "model.layers.0.mlp.up_proj.weight", "", lambda t: t.to(torch.int16),
     r"{name}.*unsupported dtype I16"),
    ("single", "model.layers.0.self_attn.o_proj.weight", "",
     lambda t: t.to(torch.float8_e4m3fn), r"{name}.*F8_E4M3.*weight_scale_inv"),
]


@pytest.mark.parametrize("ckpt,name,suffix,change,pattern", CORRUPT_TENSOR,
                         ids=["int4_logical_shape", "unsupported_dtype", "fp8_no_scale_inv"])
def test_corrupt_tensor_error_names_it(ckpts, tmp_path, ckpt, name, suffix, change,
                                       pattern) -> None:
    raw = _raw(ckpts[ckpt])
    raw[name + suffix] = change(raw[name + suffix])
    d = _rewrite(ckpts[ckpt], tmp_path / "c", raw)
    with pytest.raises(WeightsError, match=pattern.format(name=name)):
        _load(d)


def test_unsupported_quant_method_names_config(ckpts, tmp_path) -> None:
    d = tmp_path / "c"
    d.mkdir()
    cfg = json.loads((ckpts["single"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json.*unsupported quantization.*'gptq'"):
        ModelConfig.from_dir(d)


def test_no_weights_names_directory(ckpts, tmp_path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    shutil.copy(ckpts["single"] / "config.json", d / "config.json")
    with pytest.raises(WeightsError, match=rf"{d}: no model\.safetensors"):
        _load(d)


def test_tiny_config_is_valid_with_groups() -> None:
    cfg = ModelConfig.from_dict(tiny_config(experts=8, n_group=4, topk_group=2, layers=3))
    assert cfg.n_group == 4 and cfg.is_moe(2) and not cfg.is_moe(0)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "yarn"
    assert cfg.bos_token_id == cfg.vocab_size - 256 and cfg.eos_token_id == cfg.bos_token_id + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_embeddings_stay_tied(tmp_path, dtype) -> None:
    """With `tie_word_embeddings` the loaded lm_head is the embedding itself, in any dtype
    (building on the meta device and casting must not leave it an unloaded copy)."""
    d = make_tiny(tmp_path / "tied", seed=SEED, dtype="fp32", tie_word_embeddings=True)
    m = KimiForCausalLM.from_dir(d, dtype=dtype, progress=False)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(m.lm_head.weight, _raw(d)["model.embed_tokens.weight"].to(dtype))
