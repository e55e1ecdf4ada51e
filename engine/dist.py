"""Tensor-parallel process groups on torch.distributed (NCCL on GPUs, gloo on the CPU), launched
by torchrun: the collectives the sharded layers call, the leader's control channel, liveness,
and per-collective counters. Nothing here knows about models or scheduling. CPU ranks that share
a host run the data plane's collectives over Unix sockets instead (`engine.cpu_mesh`: gloo
spends about a millisecond of CPU a rank on each).

The data plane (the collectives inside the model) runs on the default process group; a separate
gloo group carries the control plane (`send`/`recv`: rank 0 tells the other ranks which model
call to make next; see `engine.leader`).

Liveness: a watchdog thread per rank beats a counter in the rendezvous store and exits the
process with a message naming the silent rank when a peer stops beating; collectives that fail
raise `PeerLost`.

Counters: `group.comm` counts calls and bytes per collective; with `group.timed = True` (eager
steps only; never while a CUDA graph is being captured) it also sums wall seconds per
collective, synchronizing the device around each call.
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.cpu_mesh import Mesh

# A step's collectives must finish within this; a peer that dies is caught sooner by the
# watchdog (heartbeat timeout) or by the transport noticing the closed connection.
COLLECTIVE_TIMEOUT_S = 600.0
# Followers wait on the control plane for as long as the leader is idle (a server with no
# requests); liveness there comes from the watchdog, not from a timeout.
CONTROL_TIMEOUT = timedelta(days=30)
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
STORE_PREFIX = "kimi-spec/tp/"
_GROUP_BROKEN = threading.Event()  # a collective failed: this process's group is unusable


class PeerLost(RuntimeError):
    """A collective failed: another rank died, hung, or closed its connection."""


@dataclass
class CommStats:
    """Per collective: calls and bytes (every eager call), wall seconds (only while timed)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.seconds.clear()


def leads(tp: int) -> bool:
    """Whether this process reads prompts and serves, known before `Group.init`: the only one,
    or rank 0 of the `tp` ranks torchrun started."""
    return tp == 1 or os.environ.get("RANK", "0") == "0"


class Group:
    """This process's place in the tensor-parallel group and its collectives.

    Create with `Group.init(W, device)` in a process started by torchrun (it reads `RANK`,
    `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). Layers take one at
    construction and hold `1 / world` of what they split; `Group(rank, world)` without process
    groups is enough to build and load a rank's shard (no collective runs).
    """

    _count = itertools.count()

    def __init__(self, rank: int, world: int, device: torch.device | str = "cpu",
                 control: Any = None):
        # NOTE: the data plane is torch's default group, never held here (see init)
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.control = control
        self.comm = CommStats()
        self.timed = False
        self._watchdog: _Watchdog | None = None
        self._mesh: Mesh | None = None  # CPU ranks of one host: collectives over Unix sockets

    @property
    def broken(self) -> bool:
        """A collective failed (in this engine or an earlier one on the same group)."""
        return _GROUP_BROKEN.is_set()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def divide(self, n: int, what: str, where: str) -> int:
        """`n / world`, or a ValueError naming `what` (a config field) and `where` (its file)."""
        if n % self.world:
            raise ValueError(f"{where}: {what} {n} is not divisible by the tensor-parallel size "
                             f"{self.world}")
        return n // self.world

    @classmethod
    def init(cls, world_size: int, device: str | torch.device = "cpu",
             heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> Group:
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size < 2:
            raise ValueError(f"tensor parallelism needs at least 2 ranks, got {world_size}")
        if env_world != world_size or "RANK" not in os.environ:
            raise ValueError(
                f"--tp {world_size} needs {world_size} processes started by torchrun "
                f"(torchrun --nproc-per-node {world_size} -m engine.generate --tp {world_size} "
                f"...); this process sees WORLD_SIZE={env_world}")
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            # NOTE: torch.distributed.nn.functional binds the default group into its functions'
            # defaults when first imported, which torch does lazily while models are built: once
            # the group exists, those defaults would hold it (see below) past leaving it.
            importlib.import_module("torch.distributed.nn.functional")

            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank,
                                    world_size=world_size,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            # NOTE: one process may run several engines on this group, so it is left at exit,
            # while the interpreter is whole. A group alive into finalization aborts the process
            # ("terminate called without an active exception") when one of its worker threads
            # frees a finished collective's tensors then: it needs the GIL, and a thread taking
            # the GIL during finalization is ended mid-destructor. A group's threads end only
            # when its last reference goes, so engines never hold the default group (their
            # collectives name none) and drop their control group on close.
            atexit.register(leave_default_group)
        # NOTE: new_group is itself a collective: every rank creates its groups in one order.
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        g = cls(rank, world_size, dev, control)
        prefix = f"{STORE_PREFIX}{next(cls._count)}/"
        if dev.type == "cpu" and int(os.environ.get("LOCAL_WORLD_SIZE", -1)) == world_size:
            g._mesh = Mesh(rank, world_size, dist.PrefixStore(prefix, _store(60.0)),
                           COLLECTIVE_TIMEOUT_S)
        g._watchdog = _Watchdog(rank, world_size, prefix, heartbeat_timeout_s)
        g._watchdog.start()
        return g

    def close(self) -> None:
        """Stop the watchdog (marking this rank finished) and leave the control group."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._mesh is not None:
            self._mesh.close()
            self._mesh = None
        # NOTE: CUDA graphs holding NCCL calls must be gone before this (LLM.close does that).
        if dist.is_initialized() and not self.broken and self.control is not None:
            dist.destroy_process_group(self.control)
            self.control = None  # the last reference: its threads end now

    # ---- data plane -----------------------------------------------------------------------------

    def _collective(self, op: str, nbytes: int, fn: Callable[[], Any]) -> None:
        self.comm.calls[op] += 1
        self.comm.bytes[op] += nbytes
        timed = self.timed and not (self.device.type == "cuda"
                                    and torch.cuda.is_current_stream_capturing())
        try:
            if not timed:
                fn()
                return
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.comm.seconds[op] += time.perf_counter() - t0
        except RuntimeError as e:
            _GROUP_BROKEN.set()
            raise PeerLost(f"tensor-parallel rank {self.rank} of {self.world}: {op} failed; a "
                           f"peer is gone or stuck ({e})") from e

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum of `x` over ranks (in place on a contiguous `x`; returns the result)."""
        x = x.contiguous()
        mesh = self._mesh
        self._collective("all_reduce", x.numel() * x.element_size(),
                         (lambda: mesh.all_reduce(x)) if mesh else (lambda: dist.all_reduce(x)))
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """`x [..., n]` from every rank -> `[..., W * n]`, rank 0's columns first."""
        x = x.contiguous()
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        mesh = self._mesh
        self._collective("all_gather", out.numel() * out.element_size(),
                         (lambda: torch.cat(mesh.exchange(x), out=out)) if mesh
                         else (lambda: gather(out, x)))
        return out.view(self.world, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)

    def broadcast_(self, x: Tensor, src: int = 0) -> Tensor:
        mesh = self._mesh
        self._collective("broadcast", x.numel() * x.element_size(),
                         (lambda: x.copy_(mesh.exchange(x)[src])) if mesh
                         else (lambda: dist.broadcast(x, src=src)))
        return x

    # ---- control plane --------------------------------------------------------------------------

    def send(self, cmd: Any) -> None:
        """Rank 0: tell the followers what to run next (any picklable object)."""
        self._control("send", [cmd])

    def recv(self) -> Any:
        """Followers: the leader's next command."""
        box: list[Any] = [None]
        self._control("recv", box)
        return box[0]

    def _control(self, what: str, box: list[Any]) -> None:
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except RuntimeError as e:
            _GROUP_BROKEN.set()
            raise PeerLost(f"tensor-parallel rank {self.rank} of {self.world}: lost the leader's "
                           f"command channel ({what}); a peer is gone ({e})") from e


def _store(timeout_s: float) -> dist.TCPStore:
    """A client of torchrun's rendezvous store (`MASTER_ADDR`, `MASTER_PORT`)."""
    return dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         int(os.environ.get("MASTER_PORT", "29500")), is_master=False,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def world_of(group: Group | None) -> int:
    return 1 if group is None else group.world


def leave_default_group() -> None:
    """Leave torch's default group (registered at exit by `Group.init`; a second call does
    nothing). Its threads end here only if no engine still holds it."""
    # NOTE: after a failed collective, leaving could wait on the lost peer: the process just exits.
    if dist.is_initialized() and not _GROUP_BROKEN.is_set():
        dist.destroy_process_group()


# ---- liveness ----------------------------------------------------------------------------------


class _Watchdog:
    """Beats a counter per rank in the rendezvous store; exits the process when a peer's counter
    stops moving for `timeout_s` (a killed or frozen rank), naming it. A rank that closed
    cleanly marks itself done and is no longer watched."""

    def __init__(self, rank: int, world: int, prefix: str, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.interval = max(0.05, min(1.0, timeout_s / 5))
        self.store = dist.PrefixStore(prefix, _store(max(timeout_s, 10.0)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval + 1)
        try:
            self.store.set(f"done{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store's host may already be gone at shutdown
            pass

    def _fatal(self, msg: str) -> None:
        sys.stderr.write(f"error: tensor-parallel rank {self.rank} of {self.world}: {msg}; "
                         f"exiting\n")
        sys.stderr.flush()
        os._exit(1)

    def _run(self) -> None:
        now = time.monotonic()
        seen = {r: (-1, now) for r in range(self.world) if r != self.rank}
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"hb{self.rank}", 1)
                for r, (last, t) in seen.items():
                    beat = self.store.add(f"hb{r}", 0)
                    if beat != last:
                        seen[r] = (beat, time.monotonic())
                    elif time.monotonic() - t > self.timeout_s and \
                            not self.store.check([f"done{r}"]):
                        self._fatal(f"rank {r} stopped responding (no heartbeat for "
                                    f"{self.timeout_s:g} s)")
            except Exception as e:  # noqa: BLE001 - any store failure means the group is gone
                if self._stop.wait(2 * self.interval):
                    return  # closing: the store's host may have left first
                self._fatal(f"lost the rendezvous store ({type(e).__name__}: {e})")
