"""Images through the server on `tools.make_tiny --vision`'s checkpoint: a chat with an image
data URL answers as the offline engine does, `/tokenize` counts the image's tokens by
Moonshot's size rule, and video parts, bad images, http URLs and too many images are 400s
naming the part, after which the server still answers. Only 127.0.0.1 is contacted."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image as PILImage

pytest.importorskip("fastapi")

from engine import LLM, SamplingParams  # noqa: E402
from engine.media import resize_plan  # noqa: E402
from engine.serve.app import build_app  # noqa: E402
from engine.serve.options import ServeConfig  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from tests.test_media import http_images  # noqa: E402, F401 - a fixture
from tests.test_serve import serving  # noqa: E402
from tools.make_tiny import make_tiny  # noqa: E402

KW = dict(progress=False, dtype="fp32", device="cpu", mode="ar", page_size=4, compile="off")


def _png(w: int, h: int, seed: int, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    img = PILImage.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    buf = io.BytesIO()
    (img if mode == "RGBA" else img.convert("RGB").convert(mode)).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(*urls: str, kind: str = "image_url") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "what is this?"}]
    parts += [{"type": kind, kind: {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k25serve"), vision=True, dtype="fp32", seed=3)


@pytest.fixture(scope="module")
def url(ckpt) -> Iterator[str]:
    app = build_app(LLM(ckpt, **KW), "tiny", config=ServeConfig(limit_mm_per_prompt=2))
    with serving(app) as base:
        yield base


def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def test_a_chat_with_an_image_answers_as_the_engine(ckpt, url):
    msgs = _chat(_url(_png(60, 40, 1)))
    r = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    offline = LLM(ckpt, **KW)
    want = offline.chat(msgs, SamplingParams(max_tokens=6, temperature=0))[0]
    ids, images = offline.encode_with_images({"messages": msgs})
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    other = post(url, "/v1/chat/completions", {"messages": _chat(_url(_png(60, 40, 9))),
                                               "max_tokens": 6, "temperature": 0})
    assert other.status_code == 200 and other.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("size,mode", [((60, 40), "RGB"), ((100, 30), "RGBA"), ((1, 1), "L"),
                                       ((317, 95), "P")])
def test_tokenize_counts_the_image_tokens_of_the_size_rule(ckpt, url, size, mode):
    msgs = _chat(_url(_png(*size, seed=2, mode=mode)))
    r = post(url, "/tokenize", {"messages": msgs})
    assert r.status_code == 200, r.text
    rendered = Tokenizer.of_model(ckpt).apply_chat_template(msgs)  # one placeholder
    n = resize_plan(*size).tokens
    assert r.json()["count"] == len(rendered) - 1 + n
    pad = rendered.index(768 + 21)  # the tiny vocabulary's <|media_pad|>
    assert r.json()["tokens"] == rendered[:pad] + [768 + 21] * n + rendered[pad + 1:]


def test_bad_image_parts_are_400s_naming_them(url):
    png = _png(64, 64, 0)
    cases = [
        (_chat("data:image/png;base64," + base64.b64encode(b"not an image").decode()),
         "messages[0].content[1]: not an image"),
        (_chat(_url(png[: len(png) // 2])), "messages[0].content[1]: cannot decode"),
        (_chat("https://example.com/a.png"), "messages[0].content[1]: fetching images"),
        (_chat(_url(png), kind="video_url"), "video_url"),
        (_chat(*[_url(png)] * 3), "at most 2 per prompt (--limit-mm-per-prompt)"),
    ]
    for msgs, words in cases:
        for path in ("/v1/chat/completions", "/tokenize"):
            extra = {"max_tokens": 2} if path != "/tokenize" else {}
            r = post(url, path, {"messages": msgs, **extra})
            assert r.status_code == 400, (path, r.text)
            assert words in r.json()["error"]["message"], (path, r.text)
    ok = post(url, "/v1/chat/completions", {"messages": _chat(_url(png)), "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_anthropic_image_blocks_and_responses_input_images(url):
    """`/v1/messages` image blocks (base64) and `/v1/responses` `input_image` parts reach the
    same prompt as the chat route's `image_url` part."""
    png = _png(60, 40, 1)
    chat = post(url, "/v1/chat/completions", {"messages": _chat(_url(png)), "max_tokens": 4,
                                              "temperature": 0}).json()
    b64 = base64.b64encode(png).decode()
    msg = post(url, "/v1/messages", {"model": "tiny", "max_tokens": 4, "temperature": 0,
                                     "messages": [{"role": "user", "content": [
                                         {"type": "text", "text": "what is this?"},
                                         {"type": "image", "source": {
                                             "type": "base64", "media_type": "image/png",
                                             "data": b64}}]}]})
    assert msg.status_code == 200, msg.text
    usage = msg.json()["usage"]  # Anthropic's input_tokens leave out what the cache read
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat["usage"][
        "prompt_tokens"]
    assert usage["cache_read_input_tokens"] > 0  # the same image: its pages hit
    resp = post(url, "/v1/responses", {"model": "tiny", "max_output_tokens": 4,
                                       "temperature": 0, "input": [{"role": "user", "content": [
                                           {"type": "input_text", "text": "what is this?"},
                                           {"type": "input_image", "image_url": _url(png)}]}]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    bad = post(url, "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}]}]})
    assert bad.status_code == 400 and "not an image" in bad.json()["error"]["message"]


def test_allow_image_urls_fetches_http_images(ckpt, url, http_images):  # noqa: F811
    base, png = http_images
    msgs = _chat(base + "/a.png")
    off = post(url, "/tokenize", {"messages": msgs})
    assert off.status_code == 400 and "--allow-image-urls" in off.json()["error"]["message"]
    app = build_app(LLM(ckpt, **KW), "tiny", config=ServeConfig(allow_image_urls=True))
    with serving(app) as on:
        r = post(on, "/tokenize", {"messages": msgs})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == post(on, "/tokenize", {"messages": _chat(_url(png))}).json()[
            "tokens"]
        missing = post(on, "/tokenize", {"messages": _chat(base + "/nothing")})
        assert missing.status_code == 400
        assert "messages[0].content[1]: fetching the image failed: HTTP 404" in missing.json()[
            "error"]["message"]
