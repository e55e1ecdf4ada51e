"""Safetensors loading of the target model: index, prefixes, FP8/INT4 dequantization, sharding hook.

Tensors are read memory-mapped, one at a time, and moved straight to the target device, so peak
host memory stays around one tensor rather than one shard.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.config import ModelConfig
from ops.quant import dequant_fp8_block, dequant_int4

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Safetensors dtype strings (as `get_slice(...).get_dtype()` reports them) by how we load them.
_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
_FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}

# `shard_fn(canonical_name, source) -> Tensor`: `source` supports tensor-style slicing
# (`source[a:b]`, `source[:, a:b]`, `source[:]`); it is the safetensors slice for plain tensors,
# and the already dequantized full tensor for INT4/FP8 ones.
ShardFn = Callable[[str, Any], torch.Tensor]


class WeightsError(ValueError):
    """A checkpoint the engine cannot load; the message names the file and/or tensor."""


def checkpoint_index(model_dir: str | Path) -> dict[str, str]:
    """Map every tensor name in the checkpoint to the path of the file holding it.

    Reads `model.safetensors.index.json` when present (its `weight_map`), else the keys of a
    single `model.safetensors`. Every file the index names must exist.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index_path}: not a valid safetensors index ({e!r})") from e
        out: dict[str, str] = {}
        for name, fname in weight_map.items():
            path = model_dir / fname
            out[name] = str(path)
        for path in sorted(set(out.values())):
            if not Path(path).is_file():
                users = sorted(n for n, p in out.items() if p == path)
                raise WeightsError(
                    f"{path}: shard listed in {index_path.name} does not exist "
                    f"(it should hold {len(users)} tensors, e.g. {users[0]!r})"
                )
        return out
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return dict.fromkeys(_open(str(single)).keys(), str(single))
    raise WeightsError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _open(path: str) -> Any:
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError, or OSError
        raise WeightsError(f"{path}: cannot read safetensors file ({e})") from e


class _Reader:
    """Lazily opened, memory-mapped shards, each opened once."""

    def __init__(self, index: dict[str, str]) -> None:
        self.index = index
        self._handles: dict[str, Any] = {}

    def has(self, name: str) -> bool:
        return name in self.index

    def slice(self, name: str) -> Any:
        path = self.index[name]
        if path not in self._handles:
            self._handles[path] = _open(path)
        try:
            return self._handles[path].get_slice(name)
        except Exception as e:
            raise WeightsError(f"{path}: cannot read tensor {name!r} ({e})") from e

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.slice(name)[:]
        except WeightsError:
            raise
        except Exception as e:
            raise WeightsError(f"{self.index[name]}: cannot read tensor {name!r} ({e})") from e


def load_target_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    progress: bool = True,
    shard_fn: ShardFn | None = None,
) -> dict[str, torch.Tensor]:
    """Load the text model's weights, dequantized to `dtype`, onto `device`.

    Keys are the names of `cfg.tensor_shapes()` without `cfg.weight_prefix`
    (`model.embed_tokens.weight`, ..., `lm_head.weight`). `e_score_correction_bias` stays fp32.
    Tensors the text model does not use (rotary `inv_freq`, vision tower, projector, MTP layers)
    are skipped. Every tensor's full stored (logical) shape is checked against the config before it
    is read; `shard_fn`, when given, then picks the piece of each tensor this process keeps (for
    tensor parallelism), and the returned pieces are not checked against the config.
    """
    model_dir = Path(model_dir)
    index = checkpoint_index(model_dir)
    reader = _Reader(index)
    expected = cfg.tensor_shapes()
    prefix = cfg.weight_prefix
    q = cfg.quantization
    group = q.group_size if q is not None and q.method == "int4" else 32
    block = q.block_size if q is not None and q.method == "fp8" else (128, 128)

    missing = [n for n in expected if n not in index and n + "_packed" not in index]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightsError(
            f"{model_dir}: tensor {missing[0]!r}{more} expected by the config is not in the "
            f"checkpoint"
        )

    # Read shard by shard so each memory map is walked front to back.
    order = sorted(expected, key=lambda n: (index.get(n) or index[n + "_packed"], n))
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(order), desc="loading weights", unit="tensor", file=sys.stderr,
               disable=not progress)
    try:
        for name in order:
            key = name.removeprefix(prefix)
            want = tuple(expected[name])
            to = torch.float32 if name.endswith("e_score_correction_bias") else dtype
            out[key] = _load_one(reader, name, key, want, to, device, group, block, shard_fn)
            bar.update(1)
    finally:
        bar.close()
    return out


def _load_one(
    reader: _Reader,
    name: str,
    key: str,
    want: tuple[int, ...],
    dtype: torch.dtype,
    device: str | torch.device,
    group: int,
    block: tuple[int, int],
    shard_fn: ShardFn | None,
) -> torch.Tensor:
    where = reader.index.get(name) or reader.index[name + "_packed"]

    def shape_error(got: tuple[int, ...], what: str = "shape") -> WeightsError:
        return WeightsError(f"{where}: tensor {name!r} has {what} {got}, the config expects "
                            f"{want}")

    if not reader.has(name):  # INT4 pack-quantized: weight_packed / weight_scale / weight_shape
        for part in ("_scale", "_shape"):
            if not reader.has(name + part):
                raise WeightsError(f"{where}: tensor {name + '_packed'!r} has no "
                                   f"{name + part!r} in the checkpoint")
        shape = tuple(int(x) for x in reader.tensor(name + "_shape").tolist())
        if shape != want:
            raise shape_error(shape)
        packed_sl = reader.slice(name + "_packed")
        if packed_sl.get_dtype() != "I32":
            raise WeightsError(f"{where}: tensor {name + '_packed'!r} has unsupported dtype "
                               f"{packed_sl.get_dtype()} (expected I32)")
        got_p = tuple(packed_sl.get_shape())
        want_p = (want[0], -(-want[1] // 8))
        if got_p != want_p:
            raise WeightsError(f"{where}: tensor {name + '_packed'!r} has shape {got_p}, "
                               f"expected {want_p} for logical shape {want}")
        scale_sl = reader.slice(name + "_scale")
        got_s = tuple(scale_sl.get_shape())
        want_s = (want[0], -(-want[1] // group))
        if got_s != want_s:
            raise WeightsError(f"{where}: tensor {name + '_scale'!r} has shape {got_s}, expected "
                               f"{want_s} for logical shape {want} and group size {group}")
        w = dequant_int4(packed_sl[:].to(device), scale_sl[:].to(device), want, group, dtype)
        return shard_fn(key, w) if shard_fn is not None else w

    sl = reader.slice(name)
    got = tuple(sl.get_shape())
    if got != want:
        raise shape_error(got)
    st_dtype = sl.get_dtype()
    if st_dtype in _FP8_DTYPES:
        if not reader.has(name + "_scale_inv"):
            raise WeightsError(f"{where}: tensor {name!r} has dtype {st_dtype} but no "
                               f"{name + '_scale_inv'!r} to dequantize it with")
        scale_inv = reader.tensor(name + "_scale_inv")
        want_s = tuple(-(-d // b) for d, b in zip(want, block))
        if tuple(scale_inv.shape) != want_s:
            raise WeightsError(f"{where}: tensor {name + '_scale_inv'!r} has shape "
                               f"{tuple(scale_inv.shape)}, expected {want_s} for {want} with "
                               f"block {block}")
        w = dequant_fp8_block(sl[:].to(device), scale_inv.to(device), block, dtype)
        return shard_fn(key, w) if shard_fn is not None else w
    if st_dtype not in _FLOAT_DTYPES:
        raise WeightsError(f"{where}: tensor {name!r} has unsupported dtype {st_dtype}")
    t = shard_fn(key, sl) if shard_fn is not None else sl[:]
    return t.to(device=device, dtype=dtype)
