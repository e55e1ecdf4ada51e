"""Images for Kimi K2.5: decoding, Moonshot's resize rule, pixel patches, token counts.

The rule (the checkpoint's `preprocessor_config.json`, `media_proc_cfg`; K2.5's values are the
defaults here): decode with PIL and convert to RGB (an alpha channel is dropped, not composited;
EXIF orientation is not applied); shrink, never enlarge, so the image holds at most
`in_patch_limit` patches of `patch_size` pixels and at most `patch_limit_on_one_side` patches a
side (the scale is the least of the three ratios, sizes truncated toward zero); resize with PIL's
bicubic; zero-pad bottom and right to multiples of `patch_size x merge_kernel_size` (28); scale
pixels to `(x / 255 - mean) / std` (2x/255 - 1 for K2.5); cut into patches row-major. The
language model sees one token per merged 2 x 2 cell of patches: `(H / 28) x (W / 28)` tokens
for a padded `H x W` image (1,369 for 1024 x 1024).

Every error is a `MediaError` naming the part it came from (`messages[0].content[1]`), so the
serving routes can answer 400 naming it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PREPROCESSOR_FILE = "preprocessor_config.json"
# A decoded image larger than this many pixels is refused before its pixels are read (a 16 MiB
# request body can hold a highly compressed image of billions of pixels).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class MediaError(ValueError):
    """An image that cannot be used; the message names the part it came from."""


@dataclass(frozen=True)
class MediaConfig:
    """`media_proc_cfg` of a checkpoint's `preprocessor_config.json` (images only)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        """Pixels a side of one language-model token (28)."""
        return self.patch_size * self.merge_kernel_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MediaConfig:
        """From a `preprocessor_config.json` dict: its `media_proc_cfg`, or the dict itself."""
        m = d.get("media_proc_cfg", d)
        mk = m.get("merge_kernel_size", 2)
        mk = int(mk[0]) if isinstance(mk, list | tuple) else int(mk)
        if m.get("fixed_output_tokens") is not None:
            raise ValueError("media_proc_cfg.fixed_output_tokens is not supported")
        return cls(
            patch_size=int(m.get("patch_size", 14)),
            merge_kernel_size=mk,
            in_patch_limit=int(m.get("in_patch_limit", 16384)),
            patch_limit_on_one_side=int(m.get("patch_limit_on_one_side", 512)),
            image_mean=tuple(float(x) for x in m.get("image_mean", (0.5,) * 3)),
            image_std=tuple(float(x) for x in m.get("image_std", (0.5,) * 3)),
        )

    @property
    def max_patches(self) -> int:
        """The most patches an image keeps: `in_patch_limit` after the shrink, and the padding
        to whole merge cells adds at most a row and a column of them."""
        return self.in_patch_limit + 2 * self.patch_limit_on_one_side + 1

    @classmethod
    def from_dir(cls, path: str | Path) -> MediaConfig:
        """The checkpoint's values where it ships `preprocessor_config.json`, else K2.5's."""
        p = Path(path) / PREPROCESSOR_FILE
        if not p.is_file():
            return cls()
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{p}: not a usable preprocessor config ({e})") from e


@dataclass(frozen=True)
class ResizePlan:
    """Where an image of a given size goes: resized to `width x height`, then padded by
    `pad_width x pad_height`."""

    width: int
    height: int
    pad_width: int
    pad_height: int
    patch_size: int
    merge: int

    @property
    def grid(self) -> tuple[int, int]:
        """Patches (rows, columns) of the padded image."""
        p = self.patch_size
        return (self.height + self.pad_height) // p, (self.width + self.pad_width) // p

    @property
    def tokens(self) -> int:
        """Language-model tokens: one per merged `merge x merge` cell of patches."""
        rows, cols = self.grid
        return (rows // self.merge) * (cols // self.merge)


def resize_plan(width: int, height: int, cfg: MediaConfig = MediaConfig()) -> ResizePlan:
    """Moonshot's size rule for a `width x height` image (see the module docstring)."""
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    scale = min(1.0,
                math.sqrt(cfg.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p))),
                side * p / width, side * p / height)
    w = min(max(1, int(width * scale)), side * p)
    h = min(max(1, int(height * scale)), side * p)
    f = cfg.factor
    return ResizePlan(w, h, (f - w % f) % f, (f - h % f) % f, p, cfg.merge_kernel_size)


@dataclass(frozen=True)
class Image:
    """One preprocessed image: `pixels [L, 3, p, p]` (fp32, numpy) for a `grid` of
    `(rows, columns)` patches, `tokens` language-model tokens, and `digest`, a hash of the
    preprocessed pixels and grid (the prefix cache's key for the image's content).
    NOTE: numpy, so the server's HTTP process, which preprocesses images, never loads torch."""

    pixels: np.ndarray
    grid: tuple[int, int]
    tokens: int
    digest: str

    @property
    def pixel_values(self) -> Any:
        """`pixels` as a torch tensor (sharing its memory), for the vision tower."""
        import torch

        return torch.from_numpy(self.pixels)


def decode_image(data: bytes, what: str = "image") -> Any:
    """A PIL image from encoded bytes, its pixels read (so a truncated file fails here)."""
    from PIL import Image as PILImage

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            img = PILImage.open(io.BytesIO(data))
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise MediaError(f"{what}: image of {img.width}x{img.height} pixels is too "
                                 f"large (at most {MAX_IMAGE_PIXELS} pixels)")
            img.load()
    except MediaError:
        raise
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning) as e:
        raise MediaError(f"{what}: image is too large ({e})") from e
    except PILImage.UnidentifiedImageError as e:
        raise MediaError(f"{what}: not an image PIL can read") from e
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise MediaError(f"{what}: cannot decode the image ({e})") from e
    return img


def fetch_url(url: str, what: str = "image", *, timeout: float = 10.0,
              max_bytes: int = 16 << 20) -> bytes:
    """The bytes at an http(s) `url`, at most `max_bytes` of them, the whole exchange within
    about `timeout` seconds per read; any failure is a `MediaError` naming `what`."""
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise MediaError(f"{what}: only http(s) URLs are fetched")
    req = urllib.request.Request(url, headers={"User-Agent": "kimi-spec"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - http(s) only
            data = r.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise MediaError(f"{what}: fetching the image failed: HTTP {e.code}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise MediaError(f"{what}: fetching the image failed ({reason})") from e
    if len(data) > max_bytes:
        raise MediaError(f"{what}: the image at the URL is larger than {max_bytes} bytes")
    return data


def decode_data_url(url: str, what: str = "image") -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    head, sep, body = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise MediaError(f"{what}: expected a data:image/...;base64,... URL")
    mime = head[5:-7]
    if mime and not mime.startswith("image/"):
        raise MediaError(f"{what}: data URL of type {mime!r} is not an image")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{what}: invalid base64 data ({e})") from e


def preprocess(img: Any, cfg: MediaConfig = MediaConfig()) -> Image:
    """A decoded PIL image -> pixel patches, grid and token count (Moonshot's rule)."""
    from PIL import Image as PILImage

    rgb = img.convert("RGB")
    plan = resize_plan(rgb.width, rgb.height, cfg)
    if (plan.width, plan.height) != rgb.size:
        rgb = rgb.resize((plan.width, plan.height), PILImage.BICUBIC)
    arr = np.pad(np.asarray(rgb, dtype=np.uint8), ((0, plan.pad_height), (0, plan.pad_width),
                                                   (0, 0)))
    # NOTE: the reference's arithmetic, step for step: x / 255 in float64 stored as float32,
    # then the float64 mean and 1 / std applied in place (each result rounded to float32).
    x = (arr / 255.0).astype(np.float32)
    x -= np.asarray(cfg.image_mean)
    x *= 1.0 / np.asarray(cfg.image_std)
    p = cfg.patch_size
    gh, gw = plan.grid
    patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    digest = hashlib.sha256(arr.tobytes() + f"{gh}x{gw}".encode()).hexdigest()
    return Image(np.ascontiguousarray(patches), (gh, gw), plan.tokens, digest)


def load_image(data: bytes, cfg: MediaConfig = MediaConfig(), what: str = "image") -> Image:
    """Encoded bytes -> a preprocessed `Image`; errors name `what`."""
    return preprocess(decode_image(data, what), cfg)


# ---- prompts -------------------------------------------------------------------------------------

IMAGE_PARTS = ("image_url", "image", "input_image")
VIDEO_PARTS = ("video_url", "video", "input_video")


def load_image_source(src: Any, cfg: MediaConfig = MediaConfig(), what: str = "image", *,
                      local_files: bool = False,
                      fetch: Callable[[str, str], bytes] | None = None) -> Image:
    """An image from what a caller gave: a PIL image, encoded bytes, a `data:` URL, an http(s)
    URL (only through `fetch(url, what)`), or a file path (only with `local_files`)."""
    if isinstance(src, bytes | bytearray):
        return load_image(bytes(src), cfg, what)
    if not isinstance(src, str):
        if hasattr(src, "convert") and hasattr(src, "size"):  # a PIL image
            return preprocess(src, cfg)
        raise MediaError(f"{what}: expected an image URL, got {type(src).__name__}")
    if src.startswith("data:"):
        return load_image(decode_data_url(src, what), cfg, what)
    if src.startswith(("http://", "https://")):
        if fetch is None:
            raise MediaError(f"{what}: fetching images over http(s) is off here (data: URLs "
                             f"only; a server fetches with --allow-image-urls)")
        return load_image(fetch(src, what), cfg, what)
    path = Path(src.removeprefix("file://"))
    if not local_files:
        raise MediaError(f"{what}: expected a data:image/...;base64,... URL")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MediaError(f"{what}: cannot read image file {str(path)!r} ({e.strerror})") from e
    return load_image(data, cfg, what)


def message_images(messages: Any, where: str = "messages") -> list[tuple[str, Any]]:
    """`(name, source)` of each image part of chat `messages`, in prompt order: OpenAI's
    `image_url` (`{"url": ...}` or the URL), Moonshot's `image` and the Responses API's
    `input_image` (`image_url`). A video part raises (only images are supported)."""
    out: list[tuple[str, Any]] = []
    for i, m in enumerate(messages or ()):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind, name = part.get("type"), f"{where}[{i}].content[{j}]"
            if kind in VIDEO_PARTS:
                raise MediaError(f"{name}: {kind} parts are not supported (images only)")
            if kind not in IMAGE_PARTS:
                continue
            src = part.get(kind) if kind != "input_image" else part.get("image_url")
            if src is None and kind == "image":
                src = part.get("image_url")
            if isinstance(src, dict):
                src = src.get("url")
            if src is None:
                raise MediaError(f"{name}: {kind} part has no image")
            out.append((name, src))
    return out


def expand_placeholders(ids: Sequence[int], images: Sequence[Image], pad_id: int,
                        what: str = "prompt") -> tuple[list[int], list[tuple[int, Image]]]:
    """Each of `ids`' `pad_id` placeholders (one per image, in order) becomes that image's
    `tokens` copies; returns the expanded ids and each image's first position in them."""
    n = sum(1 for t in ids if t == pad_id)
    if n != len(images):
        raise MediaError(f"{what}: {n} image placeholders for {len(images)} images")
    out: list[int] = []
    where: list[tuple[int, Image]] = []
    it = iter(images)
    for t in ids:
        if t == pad_id:
            im = next(it)
            where.append((len(out), im))
            out.extend([pad_id] * im.tokens)
        else:
            out.append(t)
    return out, where
