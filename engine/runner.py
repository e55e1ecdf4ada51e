"""Every model call goes through the runner: prefills, and the spec step for a batch, with
static buffers per batch size, padding rows on the dummy page, one CUDA graph per (batch size,
step kind) on a GPU, one `torch.compile`d step per (batch size, step kind) on the CPU when
asked (`compile`), and the same step eagerly otherwise.

It takes host values (`StepInputs`, `PrefillInputs`), never requests, and knows nothing of what
is inside the step: it copies the inputs into the buffers (through one pinned staging copy per
batch size on a GPU), lets an optional attention planner prepare its kernel metadata from the
host copies, replays (or calls) the step, and reads back the small decision tensors.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.config import DEFAULT_KERNELS, CompileKernels, SamplingParams
from engine.kv_cache import DUMMY_PAGE, KVPool
from engine.policy import budgets_for_sizes
from engine.spec import (
    PADDING,
    Models,
    StepBuffers,
    StepShape,
    catch_up,
    prefill,
    prefill_forward,
    spec_step,
)
from ops.sampling import row_promises, sample_from_probs, target_probs

# Called before every step and every capture, outside the graph, with the host copies of the
# page table `[bs, W]` and context lengths `[bs]` the step is about to read (a kernel backend
# plans its metadata from them here, without a device sync).
Planner = Callable[[Tensor, Tensor, int], None]
# A step is "greedy" (no row samples), "sampled" (most rows sample: the sampled budget) or
# "mixed" (half the rows or fewer sample: the sampling decide over the greedy budget's tree, since
# a greedy row's accepted drafts outweigh a sampled row's). A sampled step with a row whose
# drafter cache lags (plain steps left it behind) is "lagging" and decodes plainly: catching up
# costs a forward over the lag, more than a sampled tree wins back (1.1x where it is chosen).
# Kinds whose shapes agree share one graph.
KINDS = ("greedy", "mixed", "sampled", "lagging")
# A compiled CPU step over at most this many token rows (batch size x tree nodes) is compiled for,
# and runs on, one torch thread; a larger one gets every thread the runner has. A small step's ops
# are too small to share: the matmul library's threads and inductor's parallel loops mostly wait
# for each other. Bundled pair, 2 cores, each engine compiled at both counts, interleaved in one
# process, one thread against two: one row, AR (1 token row) 1.16x faster, the budget-4 tree (5)
# 1.35x; four rows, AR (4) 1.07x faster, the budget-4 tree (20) 0.86x.
ONE_THREAD_ROWS = 8
log = logging.getLogger("engine.runner")


@dataclass
class StepInputs:
    """One step's inputs for `b` requests, as host values. Each row owns pages up to
    `cache_len + S` (S: the most tokens this step's shape emits, `max_emit`) and brings
    `coins_per_row(b)` uniforms: the coins of the output positions this step may fill, in order
    (`Request.coins`; zeros when greedy).
    `lag` (for a step that `drafts`; empty: none) holds each row's last committed tokens whose
    drafter context plain-decoding steps left out; the step catches them up first. `lagging`
    says whether any row has such tokens (the step's shape depends on it)."""

    anchor: list[int]
    cache_len: list[int]
    pages: list[list[int]]
    params: list[SamplingParams]
    coins: list[list[float]]
    lag: list[list[int]] = field(default_factory=list)
    lagging: bool = False  # some row's drafter cache lags (`step_shape`)


@dataclass
class PrefillInputs:
    """A prefill of `tokens` (positions 0 ..) into `pages`; with `params`, the first new token
    is drawn with `coin`."""

    tokens: list[int]
    pages: list[int]
    params: SamplingParams | None = None
    coin: float = 0.0


def default_capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, then steps of 16, up to and including `max_batch_size`."""
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32) if s < max_batch_size]
    s = 48
    while s < max_batch_size:
        sizes.append(s)
        s += 16
    return sorted(set(sizes + [max_batch_size]))


class PhaseTimer:
    """Wall time per phase, summed over steps. On CUDA it synchronizes at phase edges, so use
    it for eager profiling only (a replayed graph is timed as one "step")."""

    def __init__(self, sync: bool = False):
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - t0


class CaptureError(RuntimeError):
    """Capturing a step graph failed; the message names the knobs that size the graphs."""


class StepGraphRunner:
    """One step function, many batch sizes.

    `budgets` (optional, tree mode) is a budget policy `{sampling: {batch size: tree budget}}`
    (see `engine.policy`), spread over the capture sizes; without one every step uses
    `shape.budget`. Every graph of one (size, sampling) has one budget, so its shapes stay fixed;
    one set of buffers per size serves both (`StepBuffers.fit`). `threads`: the torch threads of
    the thread that runs the steps (default: this one's); a compiled step takes `step_threads`
    of them.
    """

    def __init__(
        self, models: Models, pool: KVPool, shape: StepShape, *, max_batch_size: int,
        max_pages: int, capture_sizes: Sequence[int] | None = None, use_graphs: bool | None = None,
        timer: PhaseTimer | None = None, budgets: Mapping[bool, Mapping[int, int]] | None = None,
        planner: Planner | None = None, compile: bool = False, threads: int | None = None,
        kernels: CompileKernels = DEFAULT_KERNELS,
    ):
        self.models, self.pool = models, pool
        self.max_pages = max_pages
        self.max_batch_size = max_batch_size
        self.device = pool.target.device
        self.capture_sizes = sorted(set(capture_sizes or default_capture_sizes(max_batch_size)))
        if self.capture_sizes[-1] < max_batch_size:
            raise ValueError(f"capture sizes {self.capture_sizes} do not reach max_batch_size "
                             f"{max_batch_size}")
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the KV pool is on {self.device}")
        if compile and self.use_graphs:
            raise ValueError("compile is the CPU's step graph; on CUDA the runner captures graphs")
        self.compile = compile
        self.threads = threads or torch.get_num_threads()
        if compile:
            _keep_inductor_cache()
        self.compiled: set[tuple[int, StepShape]] = set()  # the (size, shape)s compiled so far
        self.kernels = kernels.check()  # how a compiled step's kernels are made
        if compile and self.kernels.gemm == "cpp":
            # NOTE: inductor's GEMM autotuning calls a deprecated storage API once per compile
            warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        self.timer = timer or PhaseTimer()
        self.planner = planner
        tree = shape.mode == "tree" and budgets
        spread = {s: budgets_for_sizes(budgets[s], self.capture_sizes) if tree else {}
                  for s in (False, True)}
        # (batch size, sampling) -> tree budget
        self.budgets = {(bs, s): spread[s].get(bs, shape.budget)
                        for bs in self.capture_sizes for s in (False, True)}
        self.shapes = {(bs, kind): StepShape(
            shape.mode, 0 if tree and kind == "lagging" else
            self.budgets[(bs, kind in ("sampled", "lagging"))],
            shape.block_size, kind != "greedy") for bs in self.capture_sizes for kind in KINDS}
        self.buffers = {bs: StepBuffers.allocate(bs, max_pages, self.shapes_of(bs),
                                                 models.target, self.device)
                        for bs in self.capture_sizes}
        # NOTE: host copies of every step input, pinned on CUDA so the copies in are
        # asynchronous; on the CPU the buffers themselves are the host copies.
        pin = self.device.type == "cuda"
        self.staging = {bs: {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if pin
                             else t for k, t in buf.inputs().items()}
                        for bs, buf in self.buffers.items()}
        for bs, buf in self.buffers.items():
            _pad(buf.inputs(), 0)
            _pad(self.staging[bs], 0)
        self.graphs: dict[tuple[int, StepShape], Any] = {}
        # (batch size, shape) -> {"seconds": capture wall time, "bytes": pool growth}
        self.capture_stats: dict[tuple[int, StepShape], dict[str, float]] = {}

    def shapes_of(self, bs: int) -> list[StepShape]:
        """The distinct step shapes of one batch size (one graph each)."""
        return list(dict.fromkeys(self.shapes[(bs, kind)] for kind in KINDS))

    @property
    def shape(self) -> StepShape:
        """The shape that can emit the most tokens per step: callers size page reservations
        (`max_emit`) from it, so it must cover every (batch size, sampling) shape."""
        return max(self.shapes.values(), key=lambda s: (s.max_emit, s.budget))

    def coins_per_row(self, b: int) -> int:
        """Uniforms a step of `b` rows takes per row: one per position the widest sampling shape
        may emit (a greedy step takes them too and reads none)."""
        size = self.padded_size(b)
        return max(self.shapes[(size, k)].max_emit for k in KINDS if k != "greedy")

    def step_shape(self, b: int, params: Sequence[SamplingParams], lagging: bool = False
                   ) -> StepShape:
        """The shape a step of these `b` rows runs (before its rows' sampling promises): whether
        it drafts (and so feeds the drafter's cache), and the most it can write (`max_emit`).
        `lagging`: some row's drafter cache lags."""
        return self.shapes[(self.padded_size(b), self.kind(params, lagging))]

    def kind(self, params: Sequence[SamplingParams], lagging: bool = False) -> str:
        sampled = sum(not p.greedy for p in params)
        if not sampled:
            return "greedy"
        if 2 * sampled > len(params):
            return "lagging" if lagging else "sampled"
        return "mixed"

    def step_threads(self, bs: int, shape: StepShape) -> int:
        """The torch threads a step of `shape` at batch size `bs` runs on (its compiled kernels
        are built for that count): one for small compiled steps (`ONE_THREAD_ROWS`), else all."""
        return 1 if self.compile and bs * shape.num_nodes <= ONE_THREAD_ROWS else self.threads

    def padded_size(self, b: int) -> int:
        for s in self.capture_sizes:
            if s >= b:
                return s
        raise ValueError(f"batch of {b} exceeds the largest captured size "
                         f"{self.capture_sizes[-1]}")

    # ---- capture ---------------------------------------------------------------------------------

    def _knobs(self, bs: int) -> str:
        return (f"max batch size {self.max_batch_size} (--max-batch-size), the captured sizes "
                f"{self.capture_sizes} (--capture-sizes), tree budgets "
                f"{self.budgets[(bs, False)]}/{self.budgets[(bs, True)]} (greedy/sampled) at this "
                f"size (--budget or --budget-policy), KV pool of {self.pool.num_pages} pages "
                f"(--kv-pages)")

    def _new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def _capture_one(self, bs: int, shape: StepShape, mem_pool: Any) -> Any:
        """Warm up twice on a side stream, then capture one graph into `mem_pool`."""
        host, buf = self.staging[bs], self.buffers[bs].fit(shape)
        _pad(buf.inputs(), 0)
        _pad(host, 0)
        if self.planner is not None:
            self.planner(host["page_table"], host["cache_len"], shape.num_nodes)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-ups: lazy inits, JIT loads, allocator, kernel selection
                spec_step(self.models, self.pool, buf, shape)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=mem_pool):
            spec_step(self.models, self.pool, buf, shape)
        return g

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def capture(self, progress: bool = True, lagging: bool = False) -> None:
        """Capture every (batch size, step shape) graph, largest first into one pool (or, when
        compiling, compile each step the batches will most often run, and with `lagging` the
        plain steps of lagging sampled batches too: a server, which must not stall on a
        compile, warms them up; offline they compile if they run, since every graph compiled
        beside the others makes their steps slower).

        NOTE: largest first, so the shared pool is sized by the biggest graph and the smaller
        ones reuse its blocks; the warm-ups write only to the dummy page (every row is padding).
        """
        if self.compile:
            return self._compile_all(progress, lagging)
        if not self.use_graphs:
            return
        from tqdm import tqdm

        todo = [(bs, s) for bs in sorted(self.capture_sizes, reverse=True)
                for s in self.shapes_of(bs)]
        gc.collect()
        gc.freeze()
        bs, shape = todo[0]
        try:
            mem_pool = self._new_pool()
            for bs, shape in tqdm(todo, desc="capturing step graphs", disable=not progress):
                t0, m0 = time.perf_counter(), self._reserved()
                self.graphs[(bs, shape)] = self._capture_one(bs, shape, mem_pool)
                self.capture_stats[(bs, shape)] = {
                    "seconds": time.perf_counter() - t0, "bytes": self._reserved() - m0}
        except Exception as e:
            raise CaptureError(
                f"capturing the {shape.mode} step at batch size {bs} failed: "
                f"{type(e).__name__}: {e}. Graph size is set by {self._knobs(bs)}; lower one "
                f"(or leave more GPU memory outside the KV pool) and retry.") from e
        finally:
            gc.unfreeze()

    def _compile_all(self, progress: bool, lagging: bool) -> None:
        from tqdm import tqdm

        # A sampled step's promises come from its rows (`load`): warm up untruncated samplers
        # alone, and beside greedy rows (a mixed batch takes two rows; a sampled one three).
        # NOTE: only a server (`lagging`) compiles the lagging shape ahead; offline it costs a
        # compile at start for a shape few jobs run (one more graph read 2.4% slower steps in
        # bench.spec once, but across processes, whose step times differ by as much).
        alone = {"filtered": False, "topk_rows": 0, "sort_rows": 0}
        beside = {"topk_rows": 0, "sort_rows": 0}
        kinds = [("greedy", {}, 1), ("sampled", alone, 1), ("sampled", beside, 3),
                 ("mixed", beside, 2)]
        if lagging:
            kinds += [("lagging", alone, 1), ("lagging", beside, 3)]
        todo = list(dict.fromkeys(
            (bs, replace(self.shapes[(bs, kind)], **promise)) for bs in self.capture_sizes
            for kind, promise, rows in kinds if bs >= rows))
        lone_prefill = self.compiles_prefill([[0, 0]])
        bar = tqdm(total=len(todo) + lone_prefill, desc="compiling steps", disable=not progress)
        for bs, shape in todo:
            t0 = time.perf_counter()
            with _compiling(f"the {shape.mode} step at batch size {bs}"):
                buf = self.buffers[bs].fit(shape)
                _pad(buf.inputs(), 0)
                self._run_compiled(buf, shape, min(8, self.max_pages))
            self.capture_stats[(bs, shape)] = {"seconds": time.perf_counter() - t0, "bytes": 0}
            bar.update()
        if lone_prefill:  # two tokens, on the dummy page
            with _compiling("a prompt's prefill"), torch_threads(self.threads), \
                    _tracing(self.kernels):
                prefill(self.models, self.pool, [[0, 0]], [[DUMMY_PAGE]],
                        _compiled_prefill(self.kernels))
            bar.update()
        bar.close()

    def _run_compiled(self, buf: StepBuffers, shape: StepShape, width: int) -> None:
        """The compiled step over `buf` (every row) with a page table `width` pages wide: one
        graph per (size, shape), its width symbolic (one compile serves every context length),
        compiled for and run on `step_threads` torch threads."""
        import torch._dynamo

        key = (buf.anchor.shape[0], shape)
        # A known key never compiles again (its width is symbolic), so its step skips dynamo's
        # config patch and runs only the guards that tell the graphs apart: the buffers' sizes
        # and the step shape's fields, which fix the key. The full guard walk (every weight and
        # buffer) cost 3-4% of a compiled step at four rows.
        tracing: AbstractContextManager = nullcontext()
        if key in self.compiled:
            # NOTE: set_stance takes effect when it is made, not when it is entered
            patch: Any = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        else:
            tracing = _tracing(self.kernels)
            log.info("compiling the %s step (%s%s) at batch size %d", shape.mode,
                     "" if shape.mode == "ar" else f"budget {shape.budget}, ",
                     "sampled" if shape.sample else "greedy", key[0])
            patch = torch._dynamo.config.patch(automatic_dynamic_shapes=False,
                                               recompile_limit=1 << 12,
                                               accumulated_recompile_limit=1 << 12)
        # NOTE: a contiguous table, so the full width is no other graph than a slice of it
        view = replace(buf, page_table=buf.page_table[:, :width].contiguous())
        torch._dynamo.mark_dynamic(view.page_table, 1)
        with torch.no_grad(), patch, tracing, torch_threads(self.step_threads(*key)):
            _compiled_step(self.kernels)(self.models, self.pool, view, shape)
        self.compiled.add(key)

    # ---- model calls ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, inps: Sequence[PrefillInputs]) -> list[int | None]:
        """Fill the caches of each input's `pages` with its `tokens`, all in one forward; for
        each with `params`, the first new token (drawn with its `coin` unless greedy)."""
        tokens, pages = [i.tokens for i in inps], [i.pages for i in inps]
        forward = _compiled_prefill(self.kernels) if self.compiles_prefill(tokens) else None
        # NOTE: a compiled prefill may meet a length it has no graph for, so it may trace
        with torch_threads(self.threads) if self.compile else nullcontext(), \
                _tracing(self.kernels) if forward else nullcontext():
            logits = prefill(self.models, self.pool, tokens, pages, forward)
        return [None if inp.params is None else self._first(row, inp.params, inp.coin)
                for row, inp in zip(logits, inps)]

    def compiles_prefill(self, tokens: Sequence[Sequence[int]]) -> bool:
        """Whether a prefill of `tokens` runs compiled: a lone prompt (a batch of them shares
        one eager forward's launches) short enough for the compiled forward's expert pass, in a
        compiled single process (one graph serves every length: `engine.spec.prefill`). That
        pass reads the chosen experts in place up to `KimiForCausalLM.indexed_max_tokens` where
        the bank allows (a longer prompt would compile a second graph), else runs every expert
        (`dense_moe_is_cheaper`)."""
        if not (self.compile and self.models.tp is None and len(tokens) == 1):
            return False
        target, n = self.models.target, max(len(tokens[0]), 2)
        most = target.indexed_max_tokens()
        return n <= most if most is not None else target.dense_moe_is_cheaper(n, "aligned")

    @staticmethod
    def _first(logits: Tensor, p: SamplingParams, coin: float) -> int:
        """The token drawn from last-position `logits [V]` with `p` and uniform `coin`."""
        if p.greedy:
            return int(logits.argmax())
        dev, (top_k, top_p) = logits.device, _cut(p)
        probs = target_probs(logits[None], torch.tensor([float(p.temperature)], device=dev),
                             torch.tensor([top_k], device=dev),
                             torch.tensor([float(top_p)], device=dev),
                             **row_promises([(top_k, top_p)], logits.shape[-1]),
                             sort_if_needed=True)
        return int(sample_from_probs(probs, torch.tensor([coin], device=dev))[0])

    def load(self, inp: StepInputs, pad: bool = False) -> tuple[StepBuffers, StepShape, int]:
        """Copy `inp` into the static buffers. A graph runs its whole captured size (padding
        rows included); an eager step only the batch's rows, unless `pad`. Returns the buffers
        the step reads, its shape, and the page-table width it uses."""
        b = len(inp.anchor)
        if b == 0:
            raise ValueError("a step needs at least one request")
        size, shape = self.padded_size(b), self.step_shape(b, inp.params, inp.lagging)
        fixed = self.use_graphs or self.compile  # a graph runs its whole size
        buf = self.buffers[size].rows(size if (pad or fixed) else b).fit(shape)
        cuts = [_cut(x) for x in inp.params]
        if shape.sample and not self.use_graphs:
            # Truncate only the rows that ask for it, and sort the vocabulary only for rows
            # whose cut may not fit in a bounded top-k (eagerly, only when it does not); a
            # compiled step promises for every row or none, so few variants exist.
            vocab = self.models.target.cfg.vocab_size
            promise = row_promises(cuts, vocab)
            if self.compile:
                promise = {k: size if v and k != "filtered" else v for k, v in promise.items()}
            shape = replace(shape, **promise)
        if not fixed:
            shape = replace(shape, host_reads=True)
        width = self.max_pages
        if not self.use_graphs:
            # Gather only as much context as this batch has (a captured graph needs the full
            # fixed width; a compiled one takes any of 2 pages or more, so gets whole eights:
            # a size of 1 would be a new graph). Eager steps go to the page: rounded up to 8,
            # the default job's steps took 4% longer in both modes.
            most = max(map(len, inp.pages))
            width = min(self.max_pages, -(-most // 8) * 8 if self.compile else most)
        host = self.staging[size]
        pt = host["page_table"]
        pt[:b] = DUMMY_PAGE
        for i, pages in enumerate(inp.pages):
            if len(pages) > self.max_pages:
                raise ValueError(f"row {i} holds {len(pages)} pages; the step's page table has "
                                 f"{self.max_pages}")
            pt[i, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
        S = shape.max_emit
        coins = torch.tensor(inp.coins, dtype=torch.float32).view(b, -1)
        p = inp.params
        host["anchor"][:b] = torch.tensor(inp.anchor)
        host["cache_len"][:b] = torch.tensor(inp.cache_len)
        host["temperature"][:b] = torch.tensor([1.0 if x.greedy else x.temperature for x in p])
        host["top_k"][:b] = torch.tensor([k for k, _ in cuts])
        host["top_p"][:b] = torch.tensor([q for _, q in cuts])
        if shape.sample:  # a greedy step reads no coins
            host["coins"][:b, :S] = coins[:, :S]
        _pad(host, b)
        for k, dst in self.buffers[size].inputs().items():
            if dst is not host[k]:
                dst.copy_(host[k], non_blocking=True)
        return buf, shape, width

    def run_loaded(self, buf: StepBuffers, shape: StepShape, width: int) -> None:
        """Run the step over buffers filled by `load` (replay on a GPU, eager elsewhere)."""
        bs = buf.anchor.shape[0]
        if self.planner is not None:
            with self.timer("plan"):
                host = self.staging[bs]
                self.planner(host["page_table"], host["cache_len"], shape.num_nodes)
        if self.use_graphs:
            with self.timer("step"):
                self.graphs[(bs, shape)].replay()
        elif self.compile:
            with self.timer("step"):
                self._run_compiled(buf, shape, width)
        else:
            view = replace(buf, page_table=buf.page_table[:, :width])
            spec_step(self.models, self.pool, view, shape, self.timer)

    def step(self, inp: StepInputs, pad: bool = False) -> tuple[list[list[int]], list[int]]:
        """Run one step. Returns the emitted tokens and accepted-draft counts per row."""
        b = len(inp.anchor)
        with self.timer("host"):
            buf, shape, width = self.load(inp, pad)
        if shape.drafts and any(inp.lag):
            with self.timer("catch-up"):
                for toks, n, pages in zip(inp.lag, inp.cache_len, inp.pages):
                    if toks:
                        catch_up(self.models, self.pool, toks, n - len(toks), pages)
        self.run_loaded(buf, shape, width)
        with self.timer("host"):
            # NOTE: the only device-to-host copy of a step: the small decision tensors.
            out = torch.cat([buf.accept_len[:b, None], buf.emit[:b]], dim=1).cpu()
        accept = out[:, 0].tolist()
        emit = out[:, 1:].tolist()
        return [e[: a + 1] for e, a in zip(emit, accept)], accept


# An empty kernel library this old in inductor's cache is a killed compile's, not a live link.
STALE_LINK_S = 600.0


def user_cache_dir() -> Path:
    """Where compiled steps are cached: `$XDG_CACHE_HOME/kimi-spec` (else `~/.cache/kimi-spec`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kimi-spec"


def _keep_inductor_cache() -> None:
    """Inductor's cache in `user_cache_dir()` unless the user chose one: its default lies in
    /tmp, which does not outlive the machine's next start. A compile killed while it linked
    leaves an empty kernel library there, which inductor would load, and fail on, at every
    later start: those are removed (it then builds them again), once they are older than any
    link still under way in another process."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(user_cache_dir() / "inductor")
    for lib in Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.so"):
        try:
            st = lib.stat()
            if st.st_size == 0 and time.time() - st.st_mtime > STALE_LINK_S:
                log.warning("removing %s, an empty kernel library left by an interrupted "
                            "compile", lib)
                lib.unlink()
        except OSError:  # gone meanwhile (another process cleaned it up)
            pass


def _inductor_options(kernels: CompileKernels) -> dict[str, Any]:
    """Inductor's options for a compiled graph made with `kernels` (`--compile-wrapper`,
    `--compile-gemm`). A CPU step is a thousand-odd small kernels and GEMMs. Their Python calls
    took half of a compiled step at one row: called from C++, on the bundled pair at batch 1, one
    thread, ar ran 375 -> 588 tokens/s and a budget-4 tree 511 -> 821. The matmul library's
    GEMMs over a few rows cost mostly their calls: inductor's C++ GEMM template, over weights
    frozen into the graph (so it can pack them once), ran ar 315 -> 596 and the tree 509 -> 718
    (both: 943 and 974). Token for token the same; a cold compile takes about twice as long with
    either (ar's shapes at batch 1: 130 -> 263 s, 297 s, 360 s with both)."""
    opts: dict[str, Any] = {"cpp_wrapper": kernels.wrapper == "cpp"}
    if kernels.gemm == "cpp":  # the weights are frozen while it traces (`_tracing`)
        opts.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN",
                    autotune_num_choices_displayed=0, max_autotune_report_choices_stats=False)
    return opts


def _tracing(kernels: CompileKernels) -> AbstractContextManager:
    """What must hold while dynamo traces a graph made with `kernels`: C++ GEMMs need the
    weights frozen (read as constants, so the template can pack them once; the parameters stay
    for the eager prefill and the other graphs), and dynamo reads that from inductor's global
    config, not from a compile's options (given as an option, a 16-layer stack of small linears
    ran no faster)."""
    if kernels.gemm != "cpp":
        return nullcontext()
    import torch._inductor.config as inductor

    return inductor.patch(freezing=True)


@functools.cache
def _compiled_step(kernels: CompileKernels) -> Callable[..., None]:
    """`spec_step` compiled whole (no graph breaks: `fullgraph`), made with `kernels`; dynamo
    keys its graphs by the buffers' shapes and the step shape (a constant). Run under
    `no_grad`: inference tensors cannot be traced."""
    return torch.compile(inspect.unwrap(spec_step), fullgraph=True,
                         options=_inductor_options(kernels))


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """This thread's torch threads set to `n` inside, restored after (a switch costs about
    0.1 us; the thread team stays)."""
    was = torch.get_num_threads()
    if was == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


@contextmanager
def _compiling(what: str) -> Iterator[None]:
    """Turn a failed compile of `what` into a `CaptureError` that says what to do."""
    try:
        yield
    except Exception as e:
        raise CaptureError(
            f"compiling {what} failed: "
            f"{type(e).__name__}: {e}. Inductor needs a C++ compiler (g++, or $CXX), "
            f"and its cache ({os.environ.get('TORCHINDUCTOR_CACHE_DIR')}) may be deleted "
            f"if a file there is broken; --compile off runs the step eagerly.") from e


@functools.cache
def _compiled_prefill(kernels: CompileKernels) -> Callable[..., Any]:
    """The prefill's forward (`engine.spec.prefill_forward`) compiled whole, its length
    symbolic, made with `kernels`."""
    return torch.compile(prefill_forward, fullgraph=True, options=_inductor_options(kernels))


def _cut(p: SamplingParams) -> tuple[int, float]:
    """A row's `(top_k, top_p)` as the step reads them (top-k off: 0); greedy is top-k 1."""
    return (1, 1.0) if p.greedy else (max(p.top_k, 0), p.top_p)


def _pad(inputs: dict[str, Tensor], start: int) -> None:
    """Rows `start ..` become padding rows."""
    for k, v in PADDING.items():
        inputs[k][start:] = v
