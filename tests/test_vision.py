"""The K2.5 vision tower and projector (engine/models/vision.py) against transformers'
`Kimi_K25ForConditionalGeneration` in fp32, on `tools.make_tiny --vision`'s checkpoint."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from engine.config import ConfigError, ModelConfig
from engine.media import MediaConfig, load_image
from engine.models.vision import KimiVision, VisionConfig
from tools.make_tiny import make_tiny

transformers = pytest.importorskip("transformers", minversion="5.25")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k25v"), vision=True, dtype="fp32")


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import Kimi_K25ForConditionalGeneration

    model, info = Kimi_K25ForConditionalGeneration.from_pretrained(
        ckpt, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def tower(ckpt):
    return KimiVision.from_dir(ckpt)


def test_make_tiny_vision_loads_in_transformers_with_every_key(ckpt, hf):
    model, info = hf
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25"
    assert cfg["vision_config"]["vt_hidden_size"] == model.config.vision_config.hidden_size
    # The text model loads in the engine from the same directory, under `language_model.`.
    assert ModelConfig.from_dir(ckpt).weight_prefix == "language_model."


@pytest.mark.parametrize("grids", [
    [(4, 6)],            # smaller than the 8 x 8 position table, not square
    [(8, 8)],            # the table's own size (no resampling)
    [(12, 10)],          # larger than the table
    [(2, 16), (6, 4)],   # two images packed in one call
])
def test_tower_and_projector_match_transformers(hf, tower, grids):
    model, _ = hf
    g = torch.Generator().manual_seed(sum(h * w for h, w in grids))
    L = sum(h * w for h, w in grids)
    pixels = torch.rand(L, 3, 14, 14, generator=g) * 2 - 1
    thw = torch.tensor([[1, h, w] for h, w in grids])
    with torch.no_grad():
        ref_patches = model.model.vision_tower(pixels, grid_thw=thw).last_hidden_state
        ref = model.model.get_image_features(pixels, thw).pooler_output
        patches = tower.encode_patches(pixels, grids)
        got = tower(pixels, grids)
    torch.testing.assert_close(patches, ref_patches, rtol=0, atol=2e-5)
    assert [t.shape for t in got] == [(h // 2 * w // 2, 64) for h, w in grids]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_images_do_not_see_each_other(tower):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(24, 3, 14, 14, generator=g), torch.randn(16, 3, 14, 14, generator=g)
    with torch.no_grad():
        both = tower(torch.cat([a, b]), [(4, 6), (4, 4)])
        alone = tower(a, [(4, 6)])[0], tower(b, [(4, 4)])[0]
    torch.testing.assert_close(both[0], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(both[1], alone[1], rtol=0, atol=1e-5)


def test_merge_groups_each_two_by_two_cell_row_major(tower):
    x = torch.arange(4 * 6, dtype=torch.float32)[:, None]  # patch index as its feature
    merged = tower.merge(x, [(4, 6)])
    assert merged.shape == (6, 4, 1)
    assert merged[0, :, 0].tolist() == [0, 1, 6, 7]
    assert merged[1, :, 0].tolist() == [2, 3, 8, 9]
    assert merged[3, :, 0].tolist() == [12, 13, 18, 19]
    with pytest.raises(ValueError, match="merge kernel"):
        tower.merge(torch.zeros(15, 1), [(3, 5)])


def test_k25_config_reads_moonshots_keys():
    cfg = VisionConfig.from_dir("configs/kimi-k2.5-text")
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_layers, cfg.intermediate_size) == (
        1152, 16, 27, 4304)
    assert (cfg.pos_emb_height, cfg.pos_emb_width, cfg.patch_size) == (64, 64, 14)
    assert (cfg.text_hidden_size, cfg.merge, cfg.head_dim) == (7168, 4, 72)
    with torch.device("meta"):
        n = sum(p.numel() for p in KimiVision(cfg).parameters())
    assert n == 416_866_032 + 54_277_888  # the tower and the projector of K2.5's tensor table
    assert VisionConfig.from_dict({"model_type": "deepseek_v3"}) is None


def test_unsupported_vision_configs_name_the_key():
    base = {"vt_hidden_size": 64, "vt_num_attention_heads": 4}
    with pytest.raises(ConfigError, match="mm_projector_type"):
        VisionConfig.from_dict({"vision_config": {**base, "mm_projector_type": "linear"}})
    with pytest.raises(ConfigError, match="head dim"):
        VisionConfig.from_dict({"vision_config": {**base, "vt_num_attention_heads": 32}})
    with pytest.raises(ConfigError, match="activation"):
        VisionConfig.from_dict({"vision_config": {**base, "vt_hidden_act": "relu"}})


def test_a_preprocessed_image_through_both(hf, tower):
    """Pixels from engine.media (Moonshot's preprocessing) give transformers' embeddings."""
    rng = np.random.default_rng(5)
    img = PILImage.fromarray(rng.integers(0, 256, (150, 200, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    image = load_image(buf.getvalue(), MediaConfig(in_patch_limit=48))
    assert image.tokens == image.grid[0] * image.grid[1] // 4
    model, _ = hf
    with torch.no_grad():
        ref = model.model.get_image_features(
            image.pixel_values, torch.tensor([[1, *image.grid]])).pooler_output[0]
        got = tower(image.pixel_values, [image.grid])[0]
    assert got.shape == (image.tokens, 64)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)


def test_the_tower_is_counted_whole_on_every_rank(ckpt, tower):
    """The engine's memory rule counts the tower's weights as stored, whole on each rank, and
    the encoding of the largest image the preprocessing leaves in its activation reserve."""
    from engine.memory import activation_reserve, image_activation_bytes
    from engine.models.vision import vision_weight_bytes

    stored = sum(t.numel() * 4 for t in tower.parameters())  # the tiny checkpoint is fp32
    assert vision_weight_bytes(ckpt) == stored > 0
    mc, vc = ModelConfig.from_dir(ckpt), tower.cfg
    most = MediaConfig().max_patches
    assert most >= 16384 and 128 * 128 <= most
    kw = dict(tp=1, max_batch_size=1, step_rows=1, prefill_tokens=64, dtype_bytes=2,
              cuda=True, prefill_score_bytes=0)
    with_tower = activation_reserve(mc, **kw, vision=vc, image_patches=most)
    assert with_tower.image == image_activation_bytes(vc, patches=most, dtype_bytes=2) > 0
    assert with_tower.total == activation_reserve(mc, **kw).total + with_tower.image
    # K2.5's tower at the most patches: its MLP rows alone are 16,384 x 4,304 x 2 bytes twice
    k25 = VisionConfig()
    assert image_activation_bytes(k25, patches=most, dtype_bytes=2) > 2 * 16384 * 4304 * 2
