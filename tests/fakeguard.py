"""Run a function on fake tensors to prove it has no host sync and no data-dependent shapes.

A `FakeTensorMode` without a shape environment refuses `.item()`, `.tolist()`, `bool(tensor)`,
`nonzero`, boolean-mask indexing and `torch.unique`: exactly what would break CUDA graph capture.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def fake_module(mode: FakeTensorMode, module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose parameters, buffers and plain tensor attributes (such as stacked
    expert weights) are fake. Views stay views of the same fake storage, so tied or packed
    weights keep their sharing."""
    fake = copy.deepcopy(module)
    for m in fake.modules():
        for store in (m._parameters, m._buffers, m.__dict__):
            for name, t in list(store.items()):
                if isinstance(t, torch.Tensor):
                    store[name] = mode.from_tensor(t)
    return fake


def to_fake(mode: FakeTensorMode, obj: Any) -> Any:
    """`obj` with every tensor inside (modules, dataclasses, tuples, lists, dicts) replaced by a
    fake one."""
    if isinstance(obj, torch.Tensor):
        return mode.from_tensor(obj)
    if isinstance(obj, torch.nn.Module):
        return fake_module(mode, obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: to_fake(mode, getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    if isinstance(obj, tuple):
        items = [to_fake(mode, x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [to_fake(mode, x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_fake(mode, v) for k, v in obj.items()}
    return obj


def run_on_fake(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on fake copies of the tensor arguments; returns the fake outputs."""
    mode = FakeTensorMode()
    fake_args = to_fake(mode, args)
    fake_kwargs = to_fake(mode, kwargs)
    with mode:
        return fn(*fake_args, **fake_kwargs)
