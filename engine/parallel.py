"""Tensor parallelism on torch.distributed (NCCL on GPUs, gloo on the CPU), launched by torchrun.

One model across `W` ranks:

- MLA: query heads split across ranks (`q_b_proj`/`q_proj` and `kv_b_proj` by output rows,
  `o_proj` by input columns); the latent projections `q_a_proj`, `kv_a_proj_with_mqa` and
  their norms are replicated, so every rank holds the whole latent cache.
- Dense MLP, the shared expert and every routed expert: intermediate dimension split (gate/up by
  rows, down by columns); the router is replicated, so every rank routes identically.
- Two all-reduces per decoder layer: after `o_proj` and after the MLP/MoE output.
- Embedding and lm_head split over the vocabulary; logits are all-gathered before sampling.
- The drafter is split the same way when its heads, KV heads and intermediate size divide by
  `W`, else replicated.

The data plane (the collectives inside the model) runs on the default process group; a separate
gloo group is the control plane: rank 0 runs the scheduler and, before every model call, sends
the followers what to run (a prefill's tokens and pages, or a step's inputs), so every rank makes
the same calls in the same order with the same shapes.

NOTE: the verify all-reduce is `padded_bs x N x hidden` and the drafter's `padded_bs x B x
hidden`, fixed for a captured batch size, which is what lets NCCL run inside a CUDA graph.

Every rank builds the tree and decides from the same gathered logits and the same coins; rank
0's decision is still broadcast (`broadcast_decision`) so floating point can never make the
ranks commit different tokens.

Liveness: a watchdog thread per rank beats a counter in the rendezvous store and exits the
process with a message naming the silent rank when a peer stops beating; collectives that fail
raise `PeerLost`.

All-reduce timing for profilers: `tp.comm` counts calls and bytes per collective; with
`tp.timed = True` (eager steps only; never while a CUDA graph is being captured) it also sums
wall seconds per collective, synchronizing the device around each call.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ModelConfig, SamplingParams
from engine.scheduler import Scheduler, prefill_caches
from ops.verify import Decision

if TYPE_CHECKING:
    from engine.kv_cache import KVPool
    from engine.models.dflash import DFlashDrafter, DraftConfig
    from engine.models.kimi import KimiForCausalLM
    from engine.spec import Models
    from graphs.runner import StepGraphRunner

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


# ---- the process group ---------------------------------------------------------------------------


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


class TensorParallel:
    """This process's place in the tensor-parallel group, its collectives and its sharding rules.

    Create with `TensorParallel.init(W, device)` in a process started by torchrun (it reads
    `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`).
    """

    _count = itertools.count()

    def __init__(self, rank: int, world: int, device: torch.device, group: Any, control: Any):
        self.rank, self.world, self.device = rank, world, device
        self.group, self.control = group, control
        self.comm = CommStats()
        self.timed = False
        self._watchdog: _Watchdog | None = None

    @property
    def broken(self) -> bool:
        """A collective failed (in this engine or an earlier one on the same group)."""
        return _GROUP_BROKEN.is_set()

    @classmethod
    def init(cls, world_size: int, device: str | torch.device = "cpu",
             heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> TensorParallel:
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
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank,
                                    world_size=world_size,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            # NOTE: one process may run several engines on this group, so it is left at exit,
            # while the interpreter is whole: a gloo group left to finalization can abort the
            # process ("terminate called without an active exception") after its work is done.
            atexit.register(_leave_default_group)
        # NOTE: new_group is itself a collective: every rank creates its groups in one order.
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        tp = cls(rank, world_size, dev, dist.group.WORLD, control)
        tp._watchdog = _Watchdog(rank, world_size, f"{STORE_PREFIX}{next(cls._count)}/",
                                 heartbeat_timeout_s)
        tp._watchdog.start()
        return tp

    def close(self) -> None:
        """Stop the watchdog (marking this rank finished) and leave the process group."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        # NOTE: CUDA graphs holding NCCL calls must be gone before this (LLM.close does that).
        if dist.is_initialized() and not self.broken:
            dist.destroy_process_group(self.control)

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
        self._collective("all_reduce", x.numel() * x.element_size(),
                         lambda: dist.all_reduce(x, group=self.group))
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """`x [..., n]` from every rank -> `[..., W * n]`, rank 0's columns first."""
        x = x.contiguous()
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._collective("all_gather", out.numel() * out.element_size(),
                         lambda: gather(out, x, group=self.group))
        return out.view(self.world, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)

    def broadcast_(self, x: Tensor, src: int = 0) -> Tensor:
        self._collective("broadcast", x.numel() * x.element_size(),
                         lambda: dist.broadcast(x, src=src, group=self.group))
        return x

    def broadcast_decision(self, dec: Decision) -> Decision:
        """Rank 0's decision on every rank (one fixed-size broadcast, graph-safe)."""
        S = dec.emit.shape[1]
        packed = torch.cat([dec.accept_len[:, None], dec.accept_nodes, dec.emit], dim=1)
        packed = self.broadcast_(packed.contiguous(), src=0)
        return Decision(accept_nodes=packed[:, 1:1 + S], accept_len=packed[:, 0],
                        emit=packed[:, 1 + S:])

    # ---- control plane --------------------------------------------------------------------------

    def send(self, cmd: tuple[Any, ...]) -> None:
        """Rank 0: tell the followers what to run next."""
        self._control("send", [cmd])

    def recv(self) -> tuple[Any, ...]:
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

    # ---- sharding -------------------------------------------------------------------------------

    def _divide(self, n: int, what: str, where: str) -> int:
        if n % self.world:
            raise ValueError(f"{where}: {what} {n} is not divisible by the tensor-parallel size "
                             f"{self.world}")
        return n // self.world

    def local_target_config(self, cfg: ModelConfig) -> ModelConfig:
        """The per-rank shapes: heads, dense and expert intermediate sizes divided by W."""
        where = cfg.source or "model config"
        self._divide(cfg.vocab_size, "vocab_size", where)
        dense = any(not cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
        return replace(
            cfg,
            num_attention_heads=self._divide(cfg.num_attention_heads, "num_attention_heads",
                                             where),
            intermediate_size=(self._divide(cfg.intermediate_size, "intermediate_size", where)
                               if dense else cfg.intermediate_size),
            moe_intermediate_size=(self._divide(cfg.moe_intermediate_size,
                                                "moe_intermediate_size", where)
                                   if cfg.n_routed_experts else cfg.moe_intermediate_size),
        )

    def build_target(self, cls: type[KimiForCausalLM], cfg: ModelConfig) -> KimiForCausalLM:
        """This rank's piece of the target (built on the current default device, e.g. meta).
        `model.cfg` stays the full config; layers hold the per-rank one."""
        model = cls(self.local_target_config(cfg))
        model.cfg = cfg
        H, V = cfg.hidden_size, cfg.vocab_size
        model.model.embed_tokens = VocabParallelEmbedding(V, H, self)
        for layer in model.model.layers:
            layer.tp = self  # the MLP/MoE output is reduced in DecoderLayer.ffn
            attn = layer.self_attn
            for name in ("q_b_proj", "q_proj", "kv_b_proj"):
                if hasattr(attn, name):
                    _swap(attn, name, ColumnParallelLinear)
            _swap(attn, "o_proj", RowParallelLinear, tp=self)
            mlp = layer.mlp
            mlps = ([mlp] if not hasattr(mlp, "experts")
                    else [*mlp.experts, *([mlp.shared_experts] if mlp.shared_experts else [])])
            for m in mlps:
                _swap(m, "gate_proj", ColumnParallelLinear)
                _swap(m, "up_proj", ColumnParallelLinear)
                _swap(m, "down_proj", RowParallelLinear)  # no reduce: ffn reduces the sum
        model.lm_head = VocabParallelLMHead(V, H, self)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    def target_shard_fn(self, cls: type[KimiForCausalLM], cfg: ModelConfig
                        ) -> Callable[[str, Any], Tensor]:
        with torch.device("meta"):
            return self.shard_fn(self.build_target(cls, cfg))

    def drafter_splits(self, c: DraftConfig) -> bool:
        return all(n % self.world == 0 for n in (c.num_attention_heads, c.num_key_value_heads,
                                                 c.intermediate_size))

    def build_drafter(self, cls: type[DFlashDrafter], c: DraftConfig, target_hidden: int
                      ) -> DFlashDrafter:
        """The drafter split like the target (heads, KV heads, intermediate), or replicated
        when those do not divide by W."""
        if not self.drafter_splits(c):
            return cls(c, target_hidden)
        w = self.world
        model = cls(replace(c, num_attention_heads=c.num_attention_heads // w,
                            num_key_value_heads=c.num_key_value_heads // w,
                            intermediate_size=c.intermediate_size // w), target_hidden)
        for layer in model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                _swap(layer.self_attn, name, ColumnParallelLinear)
            _swap(layer.self_attn, "o_proj", RowParallelLinear, tp=self)
            _swap(layer.mlp, "gate_proj", ColumnParallelLinear)
            _swap(layer.mlp, "up_proj", ColumnParallelLinear)
            _swap(layer.mlp, "down_proj", RowParallelLinear, tp=self)
        return model

    def shard_fn(self, model: nn.Module) -> Callable[[str, Any], Tensor]:
        """`(name, source) -> this rank's piece`, for `load_target_weights` and the drafter
        loader; `source` is a safetensors slice or a tensor (read only the piece)."""
        dims = split_dims(model)

        def fn(name: str, src: Any) -> Tensor:
            d = dims.get(name)
            if d is None:
                return src[:]
            full = src.shape[d] if isinstance(src, Tensor) else src.get_shape()[d]
            n = full // self.world
            part = slice(self.rank * n, (self.rank + 1) * n)
            return src[part] if d == 0 else src[:, part]

        return fn

    def full_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """The checkpoint's (unsplit) shape of each of `model`'s tensors."""
        dims = split_dims(model)
        out = {}
        for name, t in model.state_dict().items():
            shape = list(t.shape)
            if name in dims:
                shape[dims[name]] *= self.world
            out[name] = tuple(shape)
        return out


def _swap(parent: nn.Module, name: str, cls: type[nn.Linear], **kw: Any) -> None:
    old: nn.Linear = getattr(parent, name)
    setattr(parent, name, cls(old.in_features, old.out_features, device=old.weight.device,
                              dtype=old.weight.dtype, **kw))


def split_dims(model: nn.Module) -> dict[str, int]:
    """`{state_dict name: split dimension}` for every split tensor of `model`."""
    return {f"{name}.weight" if name else "weight": m.split_dim
            for name, m in model.named_modules() if hasattr(m, "split_dim")}


def param_bytes(model: nn.Module) -> tuple[int, int]:
    """`(all, replicated)` parameter bytes this rank holds."""
    dims = split_dims(model)
    total = rep = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        total += n
        if name not in dims:
            rep += n
    return total, rep


# ---- parallel layers ---------------------------------------------------------------------------


class ColumnParallelLinear(nn.Linear):
    """Output features split across ranks (weight rows); the output stays split."""

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, **kw: Any):
        super().__init__(in_features, out_features, bias=False, **kw)


class RowParallelLinear(nn.Linear):
    """Input features split across ranks (weight columns): each rank's output is a partial
    sum, all-reduced here when `tp` is given (else by the caller, once for several)."""

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel | None = None,
                 **kw: Any):
        super().__init__(in_features, out_features, bias=False, **kw)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        return y if self.tp is None else self.tp.all_reduce(y)


class VocabParallelEmbedding(nn.Module):
    """Rank `r` holds rows `r * V / W ..`; other ids look up zeros, and the all-reduce sums the
    one real row with zeros (exact)."""

    split_dim = 0

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.n = vocab // tp.world
        self.start = tp.rank * self.n
        self.weight = nn.Parameter(torch.empty(self.n, hidden))

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.n)
        e = F.embedding(local.clamp(0, self.n - 1), self.weight)
        return self.tp.all_reduce(e.masked_fill(~mine[..., None], 0))


class VocabParallelLMHead(nn.Module):
    """Each rank's vocabulary slice of the logits, all-gathered into the full `[..., V]`."""

    split_dim = 0

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(vocab // tp.world, hidden))

    def forward(self, h: Tensor) -> Tensor:
        return self.tp.all_gather_last(F.linear(h, self.weight))


# ---- leader and followers ----------------------------------------------------------------------


@dataclass
class StepRow:
    """One request's inputs to a step as the leader sends them; the runner reads only these.

    The coins are drawn by the leader from the request's own generator, exactly as a
    single-process step would draw them, and travel with the row."""

    rid: int
    anchor: int
    cache_len: int
    pages: list[int]
    params: SamplingParams
    drawn: Tensor

    def coins(self, n: int) -> Tensor:
        if n != self.drawn.numel():
            raise RuntimeError(f"the step asked for {n} coins, the leader drew "
                               f"{self.drawn.numel()}")
        return self.drawn


class _AnnouncingRunner:
    """Rank 0's runner: sends each step's inputs to the followers, then runs it."""

    def __init__(self, runner: StepGraphRunner, tp: TensorParallel):
        self.inner, self.tp = runner, tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self, reqs: Any, pad: bool = True) -> tuple[list[list[int]], list[int]]:
        # NOTE: as many coins as the runner draws for this batch size (one per node plus the
        # bonus), so a request's stream advances exactly as in a single-process run.
        n = self.inner.buffers[self.inner.padded_size(len(reqs))].coins.shape[1] + 1
        rows = [StepRow(r.rid, r.anchor, r.cache_len, list(r.pages), r.params, r.coins(n))
                for r in reqs]
        self.tp.send(("step", rows, pad))
        return self.inner.step(rows, pad)


class LeaderScheduler(Scheduler):
    """Rank 0's scheduler: announces every model call (prefill, step) before making it."""

    def __init__(self, tp: TensorParallel, models: Models, pool: KVPool,
                 runner: StepGraphRunner, **kw: Any):
        super().__init__(models, pool, _AnnouncingRunner(runner, tp), **kw)  # type: ignore[arg-type]
        self.tp = tp

    def fill_cache(self, ctx: list[int], pages: list[int]) -> Tensor:
        self.tp.send(("prefill", list(ctx), list(pages)))
        return super().fill_cache(ctx, pages)


def follow(tp: TensorParallel, models: Models, pool: KVPool, runner: StepGraphRunner) -> str:
    """A follower's loop: run the leader's model calls until it sends "end" (one generate call
    is over) or "stop" (shut down); returns which."""
    while True:
        cmd = tp.recv()
        kind = cmd[0]
        if kind == "prefill":
            with torch.inference_mode():
                prefill_caches(models, pool, cmd[1], cmd[2])
        elif kind == "step":
            runner.step(cmd[1], cmd[2])
        elif kind in ("end", "stop"):
            return kind
        else:
            raise RuntimeError(f"tensor-parallel rank {tp.rank}: unknown command {kind!r}")


def _leave_default_group() -> None:
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
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=max(timeout_s, 10.0)))
        self.store = dist.PrefixStore(prefix, store)
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
