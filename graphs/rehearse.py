"""The engine's life at a real checkpoint's size with no GPU (`python -m graphs.plan --rehearse`):
its own code paths, run on the meta device, counting per phase what a GPU would see.

What runs is what the engine runs with these flags: the KV pool sized by the engine's rule
(`engine.memory.size_kv_pool`) and allocated; the runner (`engine.runner.StepGraphRunner`)
with its step kinds per captured batch size; every captured step (`engine.spec.spec_step`
with the graphs' fixed-shape expert pass, as `StepGraphRunner.capture` runs it); and each
prompt prefilled in the chunks the scheduler makes (`engine.scheduler.Scheduler` calling
`StepGraphRunner.prefill`: `engine.spec.prefill` for the first chunk, `prefill_chunk` for the
rest, with the runner's eager expert pass). `DeviceMode` counts, per phase:

- activation bytes: the peak of live device storage the phase creates (a view is free; a
  storage lives while any tensor over it does), above what was live when it began;
- host syncs: what makes the host wait for the device: scalar reads (`.item()`, `.tolist()`,
  `int(t)`, `bool(t)`), copies to the host, and ops whose output shape depends on values
  (`nonzero`, boolean masks, `bincount`, `unique`, `masked_select`, `repeat_interleave`
  without an output size). Each is counted and answered with a stand-in, so the phase goes on:
  scalars read 0 (or what a stand-in holds), value-dependent shapes take their upper bound
  (every mask element true), and `bincount` spreads its input evenly over the bins (routing
  that reaches every expert, as a long prefill's does);
- launches: kernels, i.e. non-view, non-metadata aten ops, each kimi:: op and each
  collective (`CountingGroup` counts them; none moves data here).

NOTE: the meta device stands in for CUDA: every engine branch on the device type takes its
non-CPU side, as on CUDA, except where it asks for CUDA itself (pinned staging, graph capture:
the steps run as `capture` runs them, without the CUDA graph), and the Triton sampling kernels,
which plain torch tensors cannot run, take their torch twins. `FakeTensorMode`'s fake CUDA
tensors cannot be indexed on a CPU-only torch (it has no CUDA device guard), and each of its
ops costs more than a meta op. A long prompt's chunks repeat the same ops at the same shapes, so
`DeviceMode` answers an op it has seen from a cache of its outputs' shapes: what keeps a
prefill of many chunks, each through every layer, a matter of seconds.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import SamplingParams
from engine.dist import Group
from engine.llm import step_shapes
from engine.policy import Policy, default_policy
from engine.request import Request
from engine.runner import KINDS, PrefillInputs, StepGraphRunner
from engine.scheduler import Scheduler
from engine.spec import Models, StepShape, spec_step
from ops.moe import fused_workspace_bytes
from ops.paged_grid import partial_bytes

DEVICE = torch.device("meta")
aten = torch.ops.aten

# Ops that launch no kernel: allocation, metadata, aliasing without a copy.
NO_KERNEL = frozenset({
    "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh",
    "_unsafe_view", "_reshape_alias", "alias", "detach", "resize_", "set_", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset"})
# Copies between host and device (a sync when the device's data comes to the host).
COPIES = frozenset({"_to_copy", "to", "copy_", "copy"})
# Indexing that syncs only with a boolean mask (it runs `nonzero` first).
INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
SCALAR_READS = frozenset({"_local_scalar_dense", "item", "equal", "is_nonzero"})
# Functions that copy host data to the device when given a device (a blocking copy: a sync).
HOST_TO_DEVICE = (torch.tensor, torch.as_tensor)


def is_launch(func: Any) -> bool:
    """Whether an op launches a kernel on a GPU: each kimi:: op (`launches` counts its
    kernels), and every aten op that is neither a view nor allocation or metadata alone
    (`NO_KERNEL`)."""
    return _Op.of(func).launch


_LAUNCHES: dict[Any, int] = {}


class _Kernels(TorchDispatchMode):
    """Counts the kernels a kimi:: op's CUDA implementation launches (`kimi_launches`)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.n += is_launch(func)
        return func(*args, **(kwargs or {}))

    def kernel_for(self, kernel: Any, device: Any) -> Any:
        """`ops.triton_util.kernel_for`'s stand-in: a launch counts and runs nothing."""
        mode = self

        class _Grid:
            def __getitem__(self, grid: Any) -> Any:
                def launch(*args: Any, **kwargs: Any) -> None:
                    mode.n += 1
                return launch
        return _Grid()


def kimi_launches(func: Any, args: Any, kwargs: dict[str, Any] | None = None) -> int:
    """The kernels `kimi::<op>` launches on CUDA at these shapes: its own implementation run
    on the meta device as CUDA runs it (Triton where it imports), each Triton kernel counted
    as it launches (`ops.triton_util.kernel_for`) and each aten op as `is_launch` counts it
    (the INT4 expert bank: its alignment's sort and scans, two grouped GEMMs, the activation
    and the reduction). Once per shapes; 1 where the implementation cannot run on meta."""
    import sys
    from unittest import mock

    from torch._library.custom_ops import OPDEFS

    import ops.custom_ops
    import ops.triton_util

    kwargs = kwargs or {}
    try:
        key = (func, _key(args), _key(tuple(kwargs.items())))
    except TypeError:
        key = None
    if key is not None and key in _LAUNCHES:
        return _LAUNCHES[key]
    count = _Kernels()
    real = ops.triton_util.kernel_for
    # NOTE: every module that launches through `kernel_for` holds its own name for it
    where = [(m, n) for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("ops.")
             for n in ("kernel_for", "_kernel_for") if getattr(m, n, None) is real]
    opdef = OPDEFS[f"{func.namespace}::{func._overloadpacket.__name__}"]
    try:
        with mock.patch.object(ops.custom_ops, "_use_triton", lambda x: True):
            for m, n in where:
                setattr(m, n, count.kernel_for)
            with count:
                opdef._init_fn(*args, **kwargs)
        n = max(count.n, 1)
    except Exception:  # noqa: BLE001 - an implementation the meta device cannot run
        n = 1
    finally:
        for m, name in where:
            setattr(m, name, real)
    if key is not None:
        _LAUNCHES[key] = n
    return n


def launches(func: Any, args: Any, kwargs: dict[str, Any] | None = None) -> int:
    """The kernels one call of `func` launches on a GPU (`is_launch`; a kimi:: op's
    `kimi_launches`)."""
    if func.namespace == "kimi":
        return kimi_launches(func, args, kwargs)
    return int(is_launch(func))


def host_to_device(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a copy (`COPIES`) moves host data to the device in a way that blocks the host:
    from a host tensor, not `non_blocking` (the engine stages what it copies without blocking
    in pinned memory)."""
    name = func._overloadpacket.__name__
    if name == "copy_":
        src, dst = args[1], args[0]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return blocking and src.device.type == "cpu" and dst.device == DEVICE
    dest = (args[1].device if func is aten.to.other else args[1] if func is aten.to.device
            else kwargs.get("device"))
    blocking = not kwargs.get("non_blocking", False)
    return (blocking and isinstance(args[0], Tensor) and args[0].device.type == "cpu"
            and dest is not None and torch.device(dest) == DEVICE)


def kernel_workspace(name: str, args: Any) -> int:
    """Bytes the CUDA kernel behind `kimi::<name>` allocates beside its output, which its fake
    kernel (shapes only) does not: the fused experts' pair rows
    (`ops.moe.fused_workspace_bytes`), the paged attention kernels' per-split partials
    (`ops.paged_grid.partial_bytes`)."""
    if name.startswith("moe_experts"):
        x, idx, w13 = args[0], args[1], args[3]
        (T, H), k = x.shape, idx.shape[1]
        return fused_workspace_bytes(T, k, H, w13.shape[1] // 2, x.element_size())
    if name in ("mla_prefix_attention", "draft_context_attention"):
        q, cache = args[0], args[1] if name == "draft_context_attention" else args[2]
        table, page_size = (args[3], args[5]) if name == "mla_prefix_attention" else \
            (args[2], args[4])
        bs, rows, heads, _ = q.shape
        if name == "mla_prefix_attention":
            kv_heads, dv = 1, q.shape[-1]
        else:  # K then V of every KV head, `hd` wide each
            dv = q.shape[-1]
            kv_heads = cache.shape[-1] // (2 * dv)
        return partial_bytes(bs, rows, heads, table.shape[1] * page_size, cache.dtype,
                             kv_heads=kv_heads, dv=dv)
    return 0


class RehearsalError(RuntimeError):
    """The engine did something a GPU would refuse (a host tensor in a device kernel), or a
    host sync the rehearsal has no stand-in for."""


@dataclass
class Tally:
    """One phase's counts."""

    start: int  # device bytes live when the phase began
    peak: int  # the most live at once since
    launches: int = 0
    syncs: Counter[str] = field(default_factory=Counter)  # op name -> host syncs
    readbacks: int = 0  # copies of a call's result to the host (`StepGraphRunner.read`)
    collectives: int = 0
    workspace: int = 0  # the largest kernel workspace (`kernel_workspace`)

    @property
    def activation_bytes(self) -> int:
        return self.peak - self.start

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())


def _key(x: Any) -> Any:
    """What an op's output shapes depend on, hashable: a tensor's shape, strides, dtype and
    device (never its values)."""
    if isinstance(x, Tensor):
        return (x.shape, x.stride(), x.dtype, x.device)
    if isinstance(x, list | tuple):
        return tuple(_key(y) for y in x)
    return x


def _tensors(args: Sequence[Any]) -> Iterator[Tensor]:
    for a in args:
        if isinstance(a, Tensor):
            yield a
        elif isinstance(a, list | tuple):
            yield from (t for t in a if isinstance(t, Tensor))


def _outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, list | tuple) else [out]


def _sid(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _zero(dtype: torch.dtype) -> Any:
    return torch.zeros((), dtype=dtype).item()


@dataclass(frozen=True)
class _Op:
    """What the rehearsal needs to know of an op, worked out once per op."""

    name: str
    view: bool  # a view, or an in-place change of metadata: always run, never cached
    launch: bool  # a kernel when it does not sync
    checks: bool  # refuses host tensors of a dimension or more beside device ones
    # None, or when it may sync: "copy" (device to host), "scalar" (a value read on the host),
    # "indexing" (with a boolean mask), "shape" (an output shape that follows values)
    sync: str | None

    @classmethod
    def of(cls, func: Any) -> _Op:
        name, tags = func._overloadpacket.__name__, func.tags
        view = func.is_view or torch.Tag.inplace_view in tags
        sync = ("copy" if name in COPIES else "scalar" if name in SCALAR_READS else
                "indexing" if name in INDEXING else
                "shape" if torch.Tag.data_dependent_output in tags
                or torch.Tag.dynamic_output_shape in tags else None)
        launch = func.namespace == "kimi" or (func.namespace == "aten" and not view
                                              and name not in NO_KERNEL)
        return cls(name, view, launch, name not in COPIES and name not in INDEXING, sync)


def _recipe(out: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """How to make `out` again at the same input shapes: `(container, [each output: the index
    of the input it is, or its (shape, stride, dtype, device)])`; False when an output is not
    a fresh device tensor or an input itself (an `out=` argument, a view made another way)."""
    sids = {_sid(t) for t in (*_tensors(args), *_tensors(kwargs.values()))}
    parts: list[Any] = []
    for o in _outputs(out):
        if not isinstance(o, Tensor):
            return False
        same = next((i for i, a in enumerate(args) if a is o), None)
        if same is not None:
            parts.append(same)
        elif _sid(o) in sids or o.device != DEVICE:
            return False
        else:
            parts.append((o.shape, o.stride(), o.dtype, o.device))
    return (type(out) if isinstance(out, list | tuple) else None, parts)


class DeviceMode(TorchDispatchMode):
    """Runs every op on the meta device as it comes, counting into `tally` (see the module
    docstring); ops on host tensors alone run for real, uncounted. An op seen before at the
    same shapes is answered from a cache of its outputs' shapes (fresh outputs, or the input
    it writes in place) without running its meta kernel again."""

    def __init__(self, group: Group | None = None):
        super().__init__()
        self.group = group
        self.tally = Tally(0, 0)
        self.live = 0
        self.storages: dict[int, list[int]] = {}  # storage -> [bytes, tensors over it]
        self.refs: dict[int, tuple[weakref.ref, int]] = {}  # id(ref) -> (ref, its storage)
        # Stand-in contents of device tensors the host may read (a `bincount`'s counts):
        # id -> (the tensor, weakly; its values on the host).
        self.values: dict[int, tuple[weakref.ref, Tensor]] = {}
        self.cache: dict[Any, Any] = {}
        self.ops: dict[Any, _Op] = {}
        self.reading = False  # inside `readback`

    @contextmanager
    def phase(self) -> Iterator[Tally]:
        """Count what runs inside into a fresh `Tally` (collectives included). NOTE: garbage
        cycles left by earlier work are collected first, so none is freed inside the phase."""
        gc.collect()
        self.tally = tally = Tally(self.live, self.live)
        calls = sum(self.group.comm.calls.values()) if self.group is not None else 0
        with _HostData(self), self:
            yield tally
        if self.group is not None:
            tally.collectives = sum(self.group.comm.calls.values()) - calls
            tally.launches += tally.collectives

    @contextmanager
    def readback(self) -> Iterator[None]:
        """What syncs inside is the read of a call's result (a prefill's first token, as a
        step's decision): counted as `readbacks`, not as host syncs."""
        self.reading = True
        try:
            yield
        finally:
            self.reading = False

    # ---- dispatch ----------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        tensors = [*_tensors(args), *_tensors(kwargs.values())]
        if not (any(t.device == DEVICE for t in tensors) or kwargs.get("device") == DEVICE):
            return func(*args, **kwargs)  # host work runs for real
        op = self.ops.get(func) or self.ops.setdefault(func, _Op.of(func))
        if op.sync == "copy" and host_to_device(func, args, kwargs):
            self.tally.syncs[f"{op.name} to device"] += 1
        if op.sync is not None and self._syncs(func, op, args, kwargs):
            if self.reading:
                self.tally.readbacks += 1
            else:
                self.tally.syncs[op.name] += 1
            out = self._stand_in(func, op.name, args, kwargs)
            self.tally.launches += op.sync not in ("copy", "scalar")
        else:
            if op.checks and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
                raise RehearsalError(f"{func} takes a host tensor beside device tensors: a "
                                     f"CUDA kernel refuses it")
            out = self._run(func, op, args, kwargs)
            self.tally.launches += (kimi_launches(func, args, kwargs) if func.namespace == "kimi"
                                    else op.launch)
        self._track(op, tensors, out)
        if func.namespace == "kimi":
            ws = kernel_workspace(op.name, args)
            self.tally.workspace = max(self.tally.workspace, ws)
            self.tally.peak = max(self.tally.peak, self.live + ws)
        return out

    def _run(self, func: Any, op: _Op, args: Any, kwargs: dict[str, Any]) -> Any:
        """`func` on meta, or its outputs' shapes from the cache. Views, metadata changes and
        ops whose outputs alias their inputs in other ways always run (views cost little)."""
        if op.view:
            out = func(*args, **kwargs)
            if self.values and isinstance(out, Tensor) and isinstance(args[0], Tensor):
                self._view_values(func, args, kwargs, out)
            return out
        try:
            key = (func, _key(args), _key(tuple(kwargs.items())))
            recipe = self.cache.get(key)
        except TypeError:  # an unhashable argument
            return func(*args, **kwargs)
        if recipe is None:
            out = func(*args, **kwargs)
            self.cache[key] = _recipe(out, args, kwargs)
            return out
        if recipe is False:
            return func(*args, **kwargs)
        made = [args[x] if isinstance(x, int) else
                torch.empty_strided(x[0], x[1], dtype=x[2], device=x[3]) for x in recipe[1]]
        return made[0] if recipe[0] is None else recipe[0](made)

    # ---- host syncs --------------------------------------------------------------------------

    @staticmethod
    def _syncs(func: Any, op: _Op, args: Any, kwargs: dict[str, Any]) -> bool:
        """Whether this call of an op that may sync (`op.sync`) does."""
        if op.sync == "copy":
            if op.name == "copy_":
                return args[0].device.type == "cpu" and args[1].device == DEVICE
            dest = (args[1].device if func is aten.to.other else args[1]
                    if func is aten.to.device else kwargs.get("device"))
            return (args[0].device == DEVICE and dest is not None
                    and torch.device(dest).type == "cpu")
        if op.sync == "indexing":
            return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2]))
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        return True

    def _stand_in(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> Any:
        """The result of a syncing op, standing in for the values the device would have."""
        x = args[0]
        if name in COPIES:
            src = args[1] if name == "copy_" else x
            host = self._values_of(src)
            if host is None:
                host = torch.zeros(src.shape, dtype=src.dtype)
            if name == "copy_":
                return x.copy_(host)
            return host.to(kwargs.get("dtype") or src.dtype)
        if name in ("_local_scalar_dense", "item", "is_nonzero"):
            host = self._values_of(x)
            value = host.item() if host is not None and host.numel() == 1 else _zero(x.dtype)
            return bool(value) if name == "is_nonzero" else value
        if name == "equal":
            return x.shape == args[1].shape
        if name in INDEXING:
            # NOTE: every mask element true: the largest result, and the exact one where the
            # mask only drops padding that is not there (one prompt prefilled alone).
            idx: list[Tensor | None] = []
            for t in args[1]:
                if t is not None and t.dtype in (torch.bool, torch.uint8):
                    idx += [torch.empty(t.numel(), dtype=torch.int64, device=t.device)] * t.dim()
                else:
                    idx.append(t)
            return func(x, idx, *args[2:], **kwargs)
        made = self._made(func, name, args, kwargs)
        if made is None:
            raise RehearsalError(f"{func} syncs with the host and the rehearsal has no stand-in "
                                 f"for its result")
        return made

    def _made(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> Any:
        """A stand-in for an op whose output shape follows its input's values, or None."""
        x = args[0]
        dev = x.device
        if name in ("nonzero", "argwhere"):
            return torch.empty(x.numel(), x.dim(), dtype=torch.int64, device=dev)
        if name == "masked_select":
            shape = torch.broadcast_shapes(x.shape, args[1].shape)
            return torch.empty(shape.numel(), dtype=x.dtype, device=dev)
        if name == "bincount":
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            bins = (args[2] if len(args) > 2 else kwargs.get("minlength", 0)) or x.numel()
            n = x.numel()
            counts = torch.tensor([n // bins + (i < n % bins) for i in range(bins)])
            out = torch.empty(bins, device=dev, dtype=torch.int64 if weights is None
                              else torch.promote_types(weights.dtype, torch.float64))
            self.values[id(out)] = (weakref.ref(out), counts.to(out.dtype))
            return out
        if name in ("_unique2", "unique_consecutive", "unique_dim"):
            n = x.numel() if name != "unique_dim" else x.shape[args[1]]
            long = dict(dtype=torch.int64, device=dev)
            out = x.new_empty(n) if name != "unique_dim" else x.clone()
            return out, torch.empty(x.shape if name != "unique_dim" else n, **long), \
                torch.empty(n, **long)
        if func is aten.repeat_interleave.Tensor:
            host = self._values_of(x)
            n = int(host.sum()) if host is not None else x.numel()
            return torch.empty(n, dtype=torch.int64, device=dev)
        return None

    def _values_of(self, t: Tensor) -> Tensor | None:
        got = self.values.get(id(t))
        return got[1] if got is not None and got[0]() is t else None

    def _view_values(self, func: Any, args: Any, kwargs: dict[str, Any], out: Tensor) -> None:
        """A view of a tensor with stand-in contents has the same view of them."""
        host = self._values_of(args[0])
        if host is not None and not any(isinstance(a, Tensor) for a in args[1:]):
            self.values[id(out)] = (weakref.ref(out), func(host, *args[1:], **kwargs))

    # ---- live bytes --------------------------------------------------------------------------

    def _track(self, op: _Op, inputs: list[Tensor], out: Any) -> None:
        """Count the device storage the op made; views of counted storage keep it alive."""
        for t in _outputs(out):
            if not isinstance(t, Tensor) or t.device != DEVICE or any(t is a for a in inputs):
                continue
            sid = _sid(t)
            entry = self.storages.get(sid)
            if entry is None:
                if op.view or any(_sid(a) == sid for a in inputs):
                    continue  # a view of storage made before the phase: weights, pool, buffers
                entry = self.storages[sid] = [t.untyped_storage().nbytes(), 0]
                self.live += entry[0]
                self.tally.peak = max(self.tally.peak, self.live)
            entry[1] += 1
            ref = weakref.ref(t, self._gone)
            self.refs[id(ref)] = (ref, sid)

    def _gone(self, ref: weakref.ref) -> None:
        sid = self.refs.pop(id(ref))[1]
        entry = self.storages[sid]
        entry[1] -= 1
        if not entry[1]:
            del self.storages[sid]
            self.live -= entry[0]


class _HostData(TorchFunctionMode):
    """`torch.tensor(data, device=...)` and `torch.as_tensor` of host data onto the device: a
    blocking copy, counted as a host sync ("tensor to device") of `mode`'s phase. NOTE: they
    reach no dispatch mode (the tensor is made on the host and moved below the dispatcher)."""

    def __init__(self, mode: DeviceMode):
        super().__init__()
        self.mode = mode

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func in HOST_TO_DEVICE and kwargs.get("device") is not None and not (
                isinstance(args[0], Tensor) and args[0].device == DEVICE) and \
                torch.device(kwargs["device"]) == DEVICE:
            self.mode.tally.syncs["tensor to device"] += 1
        return func(*args, **kwargs)


# ---- the engine's shapes and phases ----------------------------------------------------------


def engine_shapes(models: Models, budget: int | None) -> tuple[StepShape, Policy | None,
                                                               StepShape]:
    """The runner's shape, its budget policy and the widest step, as `engine.llm.LLM` makes
    them on CUDA with `--budget budget` (None: the default, the shipped CUDA policy) and the
    default mode: a tree with a drafter; without one the engine runs plain decoding."""
    d = models.drafter
    mode, block = ("tree", d.c.block_size) if d is not None else ("ar", 2)
    return step_shapes(mode, budget, block, default_policy("cuda"))


def step_kinds(runner: StepGraphRunner, bs: int) -> list[tuple[str, StepShape]]:
    """Every step shape the runner captures at batch size `bs` (`shapes_of`), each named by the
    kinds that run it (`engine.runner.KINDS`) and, when it samples, its sampling variant
    (`engine.runner.SAMPLING_VARIANTS`: "plain", "bounded" top-k, "sort" for top-p)."""
    kinds: dict[StepShape, list[str]] = {}
    for kind in KINDS:
        kinds.setdefault(runner.shapes[(bs, kind)], []).append(kind)
    out = []
    for shape in runner.shapes_of(bs):
        base = replace(shape, filtered=True, topk_rows=None, sort_rows=None)
        name = "/".join(kinds[base])
        if shape.sample:
            name += (" sort" if shape.sort_rows else " bounded" if shape.topk_rows else
                     " plain")
        out.append((name, shape))
    return out


# The variants the runner captures when a batch first needs one (`StepGraphRunner.
# _capture_late`), beside each captured shape: (name, adjusts logits, reports log-probabilities).
LATE_VARIANTS = (("+adjust", True, False), ("+logprobs", False, True),
                 ("+adjust+logprobs", True, True))


def late_kinds(runner: StepGraphRunner, bs: int) -> list[tuple[str, StepShape]]:
    """Every step shape the runner may capture while serving at batch size `bs`: each of
    `step_kinds`' shapes in each of `LATE_VARIANTS`."""
    return [(f"{name} {suffix}", replace(shape, adjust=adjust, logprobs=logprobs))
            for name, shape in step_kinds(runner, bs)
            for suffix, adjust, logprobs in LATE_VARIANTS]


def flashinfer_imports() -> bool:
    """Whether flashinfer imports whole (`ops.attention_gpu.flashinfer_unavailable` less its
    check for a CUDA device, which the rehearsal stands in for)."""
    try:
        import flashinfer  # noqa: F401
        from flashinfer import merge_state, sampling  # noqa: F401
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata  # noqa: F401
    except Exception:  # noqa: BLE001 - whatever fails, the engine would not take it
        return False
    return True


def cuda_backend(models: Models, pool: Any, steps: Sequence[tuple[int, int]], max_pages: int,
                 sm: tuple[int, int] = (9, 0), num_sms: int = 132) -> str:
    """The backend `--attention auto` takes on a CUDA GPU of compute capability `sm` with
    `num_sms` SMs (default an H200's), in `engine.attention.BACKENDS`' order, for the runner's
    `steps` (`(padded batch size, tree nodes)`): flashinfer where it imports whole and its MLA
    kernels plan every step (`FlashInferBackend.unavailable`'s rules at those device facts),
    else the Triton kernels where Triton imports, else torch."""
    from engine.attention import BACKENDS, FlashInferBackend, PagedBackend
    from ops.attention_gpu import MLADevice, mla_unsupported_reason
    from ops.custom_ops import triton_available

    mc, facts = models.target.cfg, MLADevice(sm, None, num_sms)
    heads = models.target.model.layers[0].self_attn.num_heads
    for b in BACKENDS:
        if b is FlashInferBackend:
            if flashinfer_imports() and all(mla_unsupported_reason(
                    mc.kv_lora_rank, mc.qk_rope_head_dim, pool.target.dtype, facts,
                    num_heads=heads, num_queries=n, batch_size=bs) is None
                    for bs, n in sorted(set(steps))):
                return b.option
        elif b is PagedBackend:
            if triton_available():
                return b.option
        else:
            return b.option
    raise AssertionError("the last backend always holds")


def rehearse_step(mode: DeviceMode, runner: StepGraphRunner, bs: int, shape: StepShape) -> Tally:
    """One captured step of `shape` at batch size `bs` over the runner's static buffers (every
    row at the page table's full width), with the graphs' expert pass, as `capture` runs it."""
    buf = runner.buffers[bs].fit(shape)
    with mode.phase() as tally:
        spec_step(runner.models, runner.pool, buf, shape)
    return tally


class _Counted:
    """The runner as the scheduler sees it, counting its prefill calls."""

    def __init__(self, runner: StepGraphRunner):
        self.runner, self.calls = runner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def prefill(self, inps: Sequence[PrefillInputs]) -> list[int | None]:
        self.calls += 1
        return self.runner.prefill(inps)


def rehearse_prefill(mode: DeviceMode, runner: StepGraphRunner, *, prompt_len: int,
                     chunk: int, num_pages: int, max_model_len: int, progress: bool = False
                     ) -> tuple[Tally, int]:
    """One greedy prompt of `prompt_len` tokens, alone, through the engine's scheduler (chunks
    of `chunk` tokens, one engine step each) into a pool of `num_pages` pages, until its first
    token; returns the counts and the number of chunks."""
    from tqdm import tqdm

    vocab = runner.models.target.cfg.vocab_size
    counted = _Counted(runner)
    sched = Scheduler(counted, num_pages=num_pages, page_size=runner.pool.page_size,
                      vocab_size=vocab, max_batch_size=runner.max_batch_size,
                      max_model_len=max_model_len, prefill_chunk=chunk)
    sched.add(Request(0, [i % vocab for i in range(prompt_len)],
                      SamplingParams(max_new_tokens=1)))
    bar = tqdm(total=-(-prompt_len // chunk), desc=f"prefilling {prompt_len:,} tokens",
               unit="chunk", disable=not progress)
    read = runner.read

    def read_back(t: Tensor) -> list[Any]:
        with mode.readback():
            return read(t)

    runner.read = read_back  # type: ignore[method-assign]
    try:
        with mode.phase() as tally:
            while sched.has_work:
                sched.step()
                bar.update(counted.calls - bar.n)
    finally:
        del runner.read
        bar.close()
    return tally, counted.calls
