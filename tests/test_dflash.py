"""The DFlash drafter's attention against a naive per-head reference."""

from __future__ import annotations

import pytest
import torch

from engine.config import DraftConfig
from engine.models.dflash import DFlashDrafter
from tools.make_draft import draft_config
from tools.make_tiny import make_tiny


def _naive_attention(attn, x, cos, sin, ctx_kv, ctx_valid):
    """Repeat K/V per query head, mask invalid context, softmax: the textbook form."""
    c = attn.c
    bs, B, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).view(bs, B, c.num_attention_heads, c.head_dim))
    from ops.rope import apply_rope_half

    q = apply_rope_half(q, cos, sin)
    kv = torch.cat([ctx_kv, attn.kv(x, cos, sin)], dim=1)
    half = kv.shape[-1] // 2
    k = kv[..., :half].view(bs, -1, c.num_key_value_heads, c.head_dim)
    v = kv[..., half:].view(bs, -1, c.num_key_value_heads, c.head_dim)
    rep = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    valid = torch.cat([ctx_valid, ctx_valid.new_ones(bs, B)], dim=1)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * c.head_dim ** -0.5
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)
    return attn.o_proj(o.reshape(bs, B, -1))


def _random_drafter(tmp_path, layers: int, block_size: int, seed: int) -> DFlashDrafter:
    """A drafter for a tiny hidden-128 target, weights drawn large enough to matter."""
    make_tiny(tmp_path / "t", dtype="fp32", hidden=128)
    c = DraftConfig.from_dict(draft_config(tmp_path / "t", layers=layers, block_size=block_size))
    torch.manual_seed(seed)
    d = DFlashDrafter(c, 128)
    for p in d.parameters():
        p.data.normal_(0, 0.2)
    return d


def test_grouped_attention_equals_naive(tmp_path):
    d = _random_drafter(tmp_path, layers=1, block_size=6, seed=0)
    c = d.c
    assert c.num_attention_heads != c.num_key_value_heads  # grouped queries exercised
    bs, C, B = 3, 11, c.block_size
    x = torch.randn(bs, B, c.hidden_size)
    pos = torch.tensor([4, 0, 9])[:, None] + torch.arange(B)
    cos, sin = d._rope(pos)
    ctx_kv = torch.randn(bs, C, c.kv_dim)
    ctx_valid = torch.arange(C)[None] < torch.tensor([4, 0, 9])[:, None]  # row 1: no context
    attn = d.layers[0].self_attn
    got = attn(x, cos, sin, ctx_kv, ctx_valid)
    ref = _naive_attention(attn, x, cos, sin, ctx_kv, ctx_valid)
    assert (got - ref).abs().max().item() < 1e-5


def test_rows_limit_only_the_last_layers_queries(tmp_path):
    d = _random_drafter(tmp_path, layers=2, block_size=8, seed=1)
    c = d.c
    bs, C, B = 2, 9, c.block_size
    emb = torch.randn(bs, B, c.hidden_size)
    pos = torch.tensor([5, 9])[:, None] + torch.arange(B)
    ctx_kv = torch.randn(c.num_hidden_layers, bs, C, c.kv_dim)
    ctx_valid = torch.arange(C)[None] < torch.tensor([5, 9])[:, None]
    full = d(emb, pos, ctx_kv, ctx_valid)
    for rows in [(1, 4), (1, B), (0, 1)]:
        part = d(emb, pos, ctx_kv, ctx_valid, rows=rows)
        torch.testing.assert_close(part, full[:, rows[0]:rows[1]], rtol=1e-5, atol=1e-5)


def test_rotary_frequencies_stay_fp32_in_a_bf16_model(tmp_path):
    """Rounded to bf16 the frequencies would be off by up to 0.3% (radians off at long
    distances); both models keep them fp32 whatever their dtype."""
    from engine.models.kimi import KimiForCausalLM
    from ops.rope import rope_frequencies
    from tools.make_draft import make_draft

    t = make_tiny(tmp_path / "t", dtype="fp32")
    d = make_draft(t, tmp_path / "d")
    drafter = DFlashDrafter.from_dir(d, 64, dtype=torch.bfloat16)
    target = KimiForCausalLM.from_dir(t, dtype=torch.bfloat16, progress=False)
    c = drafter.c
    want, _ = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling,
                               c.max_position_embeddings)
    assert drafter.inv_freq.dtype == torch.float32 and torch.equal(drafter.inv_freq, want)
    assert drafter.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert target.inv_freq.dtype == torch.float32


def _kimi_drafter_dict(**changes):
    import json
    from pathlib import Path

    d = json.loads((Path(__file__).resolve().parent.parent / "configs" / "kimi-k2.5-dflash" /
                    "config.json").read_text())
    d.update(changes)
    return d


def test_published_drafter_config_spellings_load():
    """Kimi-K2.6-DFlash writes `rope_type: deepseek_yarn` (YaRN with amplitude m(f, mscale) /
    m(f, mscale_all_dim), DeepSeek's defaults 1 and 0); newer z-lab drafters keep `block_size`
    in `dflash_config` and list `layer_types`."""
    import math

    k26 = _kimi_drafter_dict(rope_scaling=None, rope_parameters={
        "rope_type": "deepseek_yarn", "rope_theta": 50000.0, "factor": 64.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0})
    c = DraftConfig.from_dict(k26)
    assert c.rope_scaling["type"] == "yarn"
    assert c.rope_scaling["attention_factor"] == pytest.approx(1 + 0.1 * math.log(64))
    newer = _kimi_drafter_dict(layer_types=["full_attention"] * 6)
    newer["dflash_config"] = {**newer["dflash_config"], "block_size": 16}
    del newer["block_size"]
    assert DraftConfig.from_dict(newer).block_size == 16


@pytest.mark.parametrize("field,value", [
    ("layer_types", ["full_attention", "sliding_attention"] * 3),
    ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
    ("residual_multiplier", 0.22), ("logits_scaling", 8.0), ("attention_bias", True),
    ("hidden_act", "gelu")])
def test_math_changing_drafter_fields_are_refused_by_name(field, value):
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match=f"d.json: fields that change .* {field}"):
        DraftConfig.from_dict(_kimi_drafter_dict(**{field: value}), source="d.json")


def test_kimi_drafters_run_yarn_at_the_ports_amplitude_unless_told():
    """A Kimi drafter whose YaRN fields imply amplitude 1.0 runs 1 + 0.1 ln(64) = 1.4159 (the
    public ports' choice); its config's `rope_amplitude`, or the engine's override, wins."""
    import math
    from dataclasses import replace

    c = DraftConfig.from_dict(_kimi_drafter_dict(rope_scaling={
        "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}))
    with torch.device("meta"):
        assert DFlashDrafter(c, 7168).rope_amplitude == pytest.approx(1 + 0.1 * math.log(64))
        assert DFlashDrafter(replace(c, rope_amplitude=1.0), 7168).rope_amplitude == 1.0
        small = DFlashDrafter(replace(c, vocab_size=1024), 7168)  # not a Kimi drafter
    assert small.rope_amplitude == 1.0  # its YaRN fields' own ratio, m(64, 1) / m(64, 1)


def test_draft_rope_amplitude_override_reaches_the_drafter(tmp_path):
    from engine import LLM
    from tools.make_draft import make_draft

    t = make_tiny(tmp_path / "t", dtype="fp32")
    d = make_draft(t, tmp_path / "d")
    llm = LLM(t, d, draft_rope_amplitude=1.25, progress=False, max_model_len=64)
    assert llm.models.drafter.rope_amplitude == 1.25


def test_latent_norms_take_the_configs_epsilon():
    from pathlib import Path

    from engine.config import ModelConfig
    from engine.models.kimi import KimiForCausalLM

    k25 = ModelConfig.from_dir(Path(__file__).resolve().parent.parent / "configs" /
                               "kimi-k2.5-text")
    assert k25.rms_norm_eps == 1e-5
    with torch.device("meta"):
        attn = KimiForCausalLM(k25).model.layers[0].self_attn
    assert attn.q_a_layernorm.eps == attn.kv_a_layernorm.eps == 1e-5
