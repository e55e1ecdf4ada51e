"""Image preprocessing (engine/media.py) against Moonshot's written rule and transformers'
`navit_resize` (its image processor needs torchvision, so the size function is read from the
installed source and run alone)."""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from engine import media
from engine.media import MediaConfig, MediaError, decode_data_url, load_image, resize_plan

# Moonshot's rule worked by hand: (width, height) -> tokens.
TOKENS = {(224, 224): 64, (512, 512): 361, (1024, 1024): 1369, (1280, 720): 1196,
          (1920, 1080): 2691, (1792, 1792): 4096, (3000, 3000): 4225, (4032, 3024): 4144,
          (7168, 14): 256, (100, 30): 8, (1, 1): 1}


def _hf_navit_resize():
    """transformers' `navit_resize` (models/kimi_k25/image_processing_kimi_k25.py), compiled
    from the installed file without importing the module (which imports torchvision)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        pytest.skip("transformers is not installed")
    path = Path(spec.origin).parent / "models/kimi_k25/image_processing_kimi_k25.py"
    if not path.is_file():
        pytest.skip("transformers has no kimi_k25 (needs >= 5.25)")
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    ns: dict = {"math": math}
    exec(compile(ast.Module([fn], []), str(path), "exec"), ns)
    return ns["navit_resize"]


def _png(img: PILImage.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _random_image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> PILImage.Image:
    rng = np.random.default_rng(seed)
    img = PILImage.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    return img if mode == "RGBA" else img.convert("RGB").convert(mode)


def test_token_counts_follow_moonshots_rule():
    for (w, h), n in TOKENS.items():
        plan = resize_plan(w, h)
        assert plan.tokens == n, (w, h)
        rows, cols = plan.grid
        assert rows % 2 == cols % 2 == 0 and rows * cols == 4 * n
        # shrink only, at most 512 patches a side, padded to multiples of 28
        assert plan.width <= w and plan.height <= h
        assert rows <= 512 + 1 and cols <= 512 + 1
        assert (plan.width + plan.pad_width) % 28 == 0 and plan.pad_width < 28


def test_sizes_match_transformers_navit_resize():
    navit = _hf_navit_resize()
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (13, 15), (28, 28), (7168, 14), (14, 7200), (10000, 30), (30, 10000),
             *TOKENS] + [tuple(int(x) for x in rng.integers(1, 6000, 2)) for _ in range(200)]
    for w, h in sizes:
        (nh, nw), (ph, pw) = navit(h, w, 14, 2, 16384, 512)
        plan = resize_plan(w, h)
        assert (plan.width, plan.height) == (nw, nh), (w, h)
        assert (plan.width + plan.pad_width, plan.height + plan.pad_height) == (pw, ph), (w, h)
        assert plan.tokens == (ph // 28) * (pw // 28)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
@pytest.mark.parametrize("size,limit", [((45, 31), 16384), ((200, 150), 40)])
def test_pixels_follow_the_written_rule(mode, size, limit):
    img = _random_image(*size, mode=mode)
    cfg = MediaConfig(in_patch_limit=limit)
    got = load_image(_png(img), cfg)
    # The rule: RGB (alpha dropped), shrink by the least ratio (truncated), PIL bicubic,
    # zero-pad bottom/right to multiples of 28, 2x/255 - 1, patches row-major, channels first.
    w, h = size
    scale = min(1.0, math.sqrt(limit / (max(1, w // 14) * max(1, h // 14))), 7168 / w, 7168 / h)
    nw, nh = max(1, int(w * scale)), max(1, int(h * scale))
    rgb = img.convert("RGB")
    if (nw, nh) != (w, h):
        rgb = rgb.resize((nw, nh), PILImage.BICUBIC)
    pw, ph = -(-nw // 28) * 28, -(-nh // 28) * 28
    canvas = np.zeros((ph, pw, 3), np.uint8)
    canvas[:nh, :nw] = np.asarray(rgb)
    want = canvas.astype(np.float64) * 2 / 255 - 1
    assert got.grid == (ph // 14, pw // 14)
    assert got.tokens == (ph // 28) * (pw // 28)
    pv = got.pixel_values.numpy()
    assert pv.dtype == np.float32 and pv.shape == (ph * pw // 196, 3, 14, 14)
    for k in range(pv.shape[0]):
        r, c = divmod(k, pw // 14)
        block = want[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].transpose(2, 0, 1)
        np.testing.assert_allclose(pv[k], block, rtol=0, atol=1e-6)
    # the padding is black: -1 after normalisation
    assert (pv[-1, :, -1, -1] == -1).all()


def test_alpha_is_dropped_not_composited():
    img = _random_image(40, 30, "RGBA", seed=1)
    opaque = img.copy()
    opaque.putalpha(255)
    clear = img.copy()
    clear.putalpha(0)
    a, b = load_image(_png(opaque)), load_image(_png(clear))
    assert (a.pixel_values == b.pixel_values).all() and a.digest == b.digest
    assert load_image(_png(_random_image(40, 30, seed=2))).digest != a.digest


def test_preprocessor_config_is_read_when_present(tmp_path):
    assert MediaConfig.from_dir(tmp_path) == MediaConfig()
    cfg = {"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 64,
                              "patch_limit_on_one_side": 8, "image_mean": [0.5] * 3,
                              "image_std": [0.5] * 3, "fixed_output_tokens": None}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    got = MediaConfig.from_dir(tmp_path)
    assert (got.in_patch_limit, got.patch_limit_on_one_side) == (64, 8)
    assert resize_plan(1024, 1024, got).tokens == 16
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        MediaConfig.from_dir(tmp_path)


def test_bad_images_name_the_part(monkeypatch):
    what = "messages[0].content[1]"
    with pytest.raises(MediaError, match=r"messages\[0\]\.content\[1\]: not an image"):
        load_image(b"plain text, not pixels", what=what)
    png = _png(_random_image(64, 64))
    with pytest.raises(MediaError, match=r"content\[1\]: cannot decode"):
        load_image(png[: len(png) // 2], what=what)
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(MediaError, match=r"content\[1\]: image of 64x64 pixels is too large"):
        load_image(png, what=what)


def test_data_urls():
    png = _png(_random_image(8, 8))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert decode_data_url(url) == png
    with pytest.raises(MediaError, match="img: expected a data:image"):
        decode_data_url("https://example.com/a.png", "img")
    with pytest.raises(MediaError, match="not an image"):
        decode_data_url("data:text/plain;base64,aGk=", "img")
    with pytest.raises(MediaError, match="invalid base64"):
        decode_data_url("data:image/png;base64,@@@", "img")


@pytest.fixture
def http_images():
    """A loopback http server: /a.png an image, /big 4 KiB, anything else 404."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    png = _png(_random_image(30, 20))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = {"/a.png": png, "/big": b"x" * 4096}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", png
    server.shutdown()
    thread.join(5)


def test_fetching_is_opt_in_and_bounded(http_images):
    base, png = http_images
    with pytest.raises(MediaError, match="img: fetching images over http.s. is off"):
        media.load_image_source(base + "/a.png", what="img")
    fetch = media.fetch_url
    got = media.load_image_source(base + "/a.png", what="img", fetch=fetch)
    assert got.digest == load_image(png).digest
    with pytest.raises(MediaError, match="img: fetching the image failed: HTTP 404"):
        fetch(base + "/nothing", "img")
    with pytest.raises(MediaError, match="img: the image at the URL is larger than 1000 bytes"):
        fetch(base + "/big", "img", max_bytes=1000)
    with pytest.raises(MediaError, match="img: only http"):
        fetch("file:///etc/passwd", "img")
