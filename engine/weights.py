"""Safetensors loading, for the target and the drafter alike: the index, prefixes, FP8/INT4
dequantization, and per-rank pieces.

Tensors are read memory-mapped, one at a time, and copied straight into the model's parameters
on the target device, so peak host memory stays around one tensor rather than one shard.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.config import Quantization
from ops.quant import dequant_fp8_block, dequant_int4

if TYPE_CHECKING:
    from engine.models.layers import Stored

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Safetensors dtype strings (as `get_slice(...).get_dtype()` reports them) by how we load them.
_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
_FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}

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


def load_checkpoint(
    model_dir: str | Path,
    tensors: Mapping[str, Stored],
    *,
    prefix: str = "",
    quant: Quantization | None = None,
    progress: bool = True,
) -> None:
    """Copy every tensor of `tensors` (checkpoint names without `prefix`, see
    `engine.models.layers.checkpoint_tensors`) from the checkpoint in `model_dir` into its
    destination: only this rank's piece is read. INT4 pack-quantized and FP8 block tensors are
    dequantized on the way (whole, then cut). Each tensor's stored shape is checked first;
    tensors nobody asked for (rotary `inv_freq`, MTP layers; the vision tower and projector
    when the text model loads: `engine.models.vision` asks for those) are skipped.
    """
    model_dir = Path(model_dir)
    index = checkpoint_index(model_dir)
    reader = _Reader(index)
    group = quant.group_size if quant is not None and quant.method == "int4" else 32
    block = quant.block_size if quant is not None and quant.method == "fp8" else (128, 128)
    names = {prefix + k: k for k in tensors}
    missing = [n for n in names if n not in index and n + "_packed" not in index]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightsError(
            f"{model_dir}: tensor {missing[0]!r}{more} expected by the config is not in the "
            f"checkpoint"
        )
    # Read shard by shard so each memory map is walked front to back.
    order = sorted(names, key=lambda n: (index.get(n) or index[n + "_packed"], n))
    bar = tqdm(total=len(order), desc="loading weights", unit="tensor", file=sys.stderr,
               disable=not progress)
    try:
        with torch.no_grad():
            for name in order:
                s = tensors[names[name]]
                if s.dest is None:
                    _check_value(reader, name, s)
                else:
                    s.dest.copy_(_load_one(reader, name, s, group, block))
                bar.update(1)
    finally:
        bar.close()


def _check_value(reader: _Reader, name: str, s: Stored) -> None:
    """An INT4 linear's `weight_shape`: the logical shape the layer was built for."""
    got = tuple(int(x) for x in reader.tensor(name).tolist())
    if got != s.value:
        raise WeightsError(f"{reader.index[name]}: tensor {name!r} has shape {got}, the config "
                           f"expects {s.value}")


def _load_one(reader: _Reader, name: str, s: Stored, group: int, block: tuple[int, int]
              ) -> torch.Tensor:
    """This rank's piece of checkpoint tensor `name`, as described by `s`: as stored when the
    layer keeps it so (INT4 words, FP8 weights, their scales), else as floats of the layer's
    dtype (a quantized tensor is then dequantized whole, then cut)."""
    where = reader.index.get(name) or reader.index[name + "_packed"]
    want = s.shape
    dtype, device = s.dest.dtype, s.dest.device

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
        return s.piece(w)

    sl = reader.slice(name)
    got = tuple(sl.get_shape())
    if got != want:
        raise shape_error(got)
    st_dtype = sl.get_dtype()
    kept = {torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3"}.get(dtype)
    if kept is not None:
        if st_dtype != kept:
            raise WeightsError(f"{where}: tensor {name!r} has dtype {st_dtype}; the layer keeps "
                               f"it as stored, {kept}")
        return s.piece(sl).to(device)
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
        return s.piece(w)
    if st_dtype not in _FLOAT_DTYPES:
        raise WeightsError(f"{where}: tensor {name!r} has unsupported dtype {st_dtype}")
    return s.piece(sl).to(device=device, dtype=dtype)
