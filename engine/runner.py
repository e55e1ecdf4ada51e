"""Every model call goes through the runner: prefills, and the spec step for a batch, with
static buffers per batch size, padding rows on the dummy page, one CUDA graph per (batch size,
step kind, sampling variant: `SAMPLING_VARIANTS`) on a GPU, the CPU's compiled steps when asked
(`compile`: `engine.cpu`, called through the same two calls as graph capture, `build` and
`run`), and the same step eagerly otherwise.

It takes host values (`StepInputs`, `PrefillInputs`), never requests, and knows nothing of what
is inside the step: it copies the inputs into the buffers (through one pinned staging copy per
batch size on a GPU), lets the attention backend plan its kernels from the host copies
(`models.attention.plan`, outside the graph, without a device sync), replays (or calls) the
step, and reads back the small decision tensors.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from engine.config import Logprob, SamplingParams
from engine.cpu import COMPILE_HINT, CompiledCPUSteps, eager_expert_pass
from engine.heap import frozen_heap
from engine.kv_cache import KVPool
from engine.page_table import StagedPageTables
from engine.policy import budgets_for_sizes
from engine.spec import (
    ADJUST_INPUTS,
    PADDING,
    Embeds,
    ExpertPass,
    Models,
    StepBuffers,
    StepShape,
    aligned_pass,
    catch_up,
    prefill,
    prefill_chunk,
    prompt_logprobs,
    spec_step,
)
from ops.logits import MIN_LOGPROB, add_bias_, mask_, token_logprobs
from ops.sampling import TOPK_BOUND, row_promises, sample_from_probs, target_probs

# A step is "greedy" (no row samples), "sampled" (most rows sample: the sampled budget) or
# "mixed" (half the rows or fewer sample: the sampling decide over the greedy budget's tree, since
# a greedy row's accepted drafts outweigh a sampled row's). A sampled step with a row whose
# drafter cache lags (plain steps left it behind) is "lagging" and decodes plainly: catching up
# costs a forward over the lag, more than a sampled tree wins back where it is chosen.
# Kinds whose shapes agree share one graph.
KINDS = ("greedy", "mixed", "sampled", "lagging")
# A sampled shape is captured once per sampling variant, and each step replays the cheapest one
# its rows' `(top_k, top_p)` allow (`sampling_variant`, on the host): "plain" when no row
# truncates beyond top-k 1 (untruncated rows keep the tempered softmax, greedy and padding rows
# take an argmax: no topk, no sort); "bounded" when every truncating row cuts inside
# `ops.sampling.TOPK_BOUND` candidates (one topk, always exact: a top-k within the bound);
# "sort" when some row may need the whole vocabulary sorted (top-p without a top-k inside the
# bound, or a top-k past it; the graph takes the bounded cut where it is exact and the sort's
# elsewhere by `torch.where`). So one batch size captures one greedy graph and three per
# distinct sampled shape: 4 without a budget policy, at most 10 with one (mixed, sampled and
# lagging budgets all different).
SAMPLING_VARIANTS = ("plain", "bounded", "sort")


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
    # Each row's grammar mask of its next token (an int32 numpy bitmask of ceil(V / 32) words,
    # `ops.logits`'s layout), None for a row without a grammar; empty: no row has one. A row
    # with a mask decodes plainly: one token a step, drawn from its masked root.
    masks: list[Any] = field(default_factory=list)
    # Each row's page-table id: the same id, the same list of pages, grown at its end only
    # (a new id when a request's pages are freed and taken again). The runner then writes
    # only the pages added since it last staged that id; empty: every row written whole.
    tables: list[int] = field(default_factory=list)


# Images whose features the runner keeps between the chunks of their prompts.
IMAGE_CACHE = 4


@dataclass
class PrefillInputs:
    """A prefill of `tokens` at positions `start ..` into `pages` (which hold positions
    `0 .. start - 1` already: a chunk of a longer prompt); with `params`, the token after them
    is drawn with `coin`."""

    tokens: list[int]
    pages: list[int]
    params: SamplingParams | None = None
    coin: float = 0.0
    start: int = 0
    mask: Any = None  # the grammar's mask of that token (as in `StepInputs.masks`), if any
    # The images whose placeholder tokens these positions overlap: (the position of the
    # image's first token in the whole sequence, the image as `engine.media.Image`). Each
    # rank encodes them (the tower is replicated) and puts the rows of these positions in.
    images: list[tuple[int, Any]] = field(default_factory=list)


def _logprob(token: int, logprob: float, top: Sequence[float], ids: Sequence[int], k: int
             ) -> Logprob:
    return Logprob(token, max(logprob, MIN_LOGPROB),
                   tuple((i, max(v, MIN_LOGPROB)) for i, v in zip(ids[:k], top[:k])))


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
    the thread that runs the steps (default: this one's); a compiled step takes
    `CompiledCPUSteps.threads_for` of them.
    """

    def __init__(
        self, models: Models, pool: KVPool, shape: StepShape, *, max_batch_size: int,
        max_pages: int, capture_sizes: Sequence[int] | None = None, use_graphs: bool | None = None,
        timer: PhaseTimer | None = None, budgets: Mapping[bool, Mapping[int, int]] | None = None,
        compile: bool = False, threads: int | None = None,
    ):
        self.models, self.pool = models, pool
        self._image_cache: dict[str, Tensor] = {}  # digest -> features, oldest first
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
        if compile and (self.use_graphs or self.device.type != "cpu"):
            raise ValueError("compile is the CPU's step graph; on CUDA the runner captures graphs")
        self.threads = threads or torch.get_num_threads()
        self.compiled = CompiledCPUSteps(models, self.pool, self.threads) if compile else None
        # How the target's expert banks run a forward of n tokens: the fixed-shape aligned pass
        # a CUDA graph needs, the compiled CPU step's choice, or on the CPU eagerly each token
        # through its chosen experts (every expert where that costs less); eager forwards
        # beside graphs (prefills, catch-ups) take the eager pass. NOTE: off the CPU that is
        # the aligned pass too: grouped Triton expert GEMMs at any token count, where the
        # sparse pass reads the routing on the host and loops over experts in Python.
        cpu = self.device.type == "cpu"
        self.eager_pass: ExpertPass = eager_expert_pass(models.target) if cpu else aligned_pass
        self.expert_pass: ExpertPass = (
            aligned_pass if self.use_graphs else
            self.compiled.expert_pass if self.compiled is not None else self.eager_pass)
        self.timer = timer or PhaseTimer()
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
        # NOTE: numpy views of the staging (the same memory): the host writes its few values a
        # step through them, each write a small fraction of a torch op's overhead; none on the
        # meta device, whose runner (`graphs.plan`) never loads a step.
        self._host_np = {bs: {k: t.numpy() for k, t in host.items()}
                         for bs, host in self.staging.items() if self.device.type != "meta"}
        # What the staging of each padded size holds from the last step, so a step writes only
        # what changed: its page tables' rows (`StagedPageTables`); per input, the rows written
        # since they were padding; the sampling parameters its rows were staged with.
        self.page_tables = StagedPageTables(self.capture_sizes, max_pages)
        self._written: dict[int, dict[str, int]] = {}
        self._staged_params: dict[int, list[SamplingParams]] = {}
        self._sampled: tuple[list[SamplingParams], int] = ([], 0)  # (params, rows that sample)
        for bs in self.capture_sizes:
            self._forget(bs)
        # (padded size, rows, shape) -> the buffers' views; (base shape, ...) -> a step's shape
        self._views: dict[tuple[int, int, StepShape], StepBuffers] = {}
        self._step_shapes: dict[tuple[Any, ...], StepShape] = {}
        self.graphs: dict[tuple[int, StepShape], Any] = {}
        # (batch size, shape) -> {"seconds": capture wall time, "bytes": pool growth}
        self.capture_stats: dict[tuple[int, StepShape], dict[str, float]] = {}
        self.mem_pool: Any = None  # the graphs' memory pool (`capture`)
        # (batch size, shape) -> why capturing it while serving failed (`_capture_late`)
        self.capture_failures: dict[tuple[int, StepShape], str] = {}
        # The log-probabilities of the last call's rows (`step`) or inputs (`prefill`): for
        # each one whose params ask, a `Logprob` per token it emitted; None for the others.
        self.last_logprobs: list[list[Logprob] | None] = []

    def shapes_of(self, bs: int) -> list[StepShape]:
        """The distinct step shapes of one batch size (one graph each): with graphs, every
        sampled shape once per sampling variant (`SAMPLING_VARIANTS`)."""
        shapes = dict.fromkeys(self.shapes[(bs, kind)] for kind in KINDS)
        if self.use_graphs:
            shapes = dict.fromkeys(
                replace(s, **variant_promises(v, bs)) if s.sample else s
                for s in shapes for v in SAMPLING_VARIANTS)
        return list(shapes)

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
        # NOTE: a batch's rows keep their parameters from step to step (and each step asks
        # twice): counted again only when they change
        if self._sampled[0] != params:
            self._sampled = (list(params), sum(not p.greedy for p in params))
        sampled = self._sampled[1]
        if not sampled:
            return "greedy"
        if 2 * sampled > len(params):
            return "lagging" if lagging else "sampled"
        return "mixed"

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

    def _capture_one(self, bs: int, shape: StepShape, mem_pool: Any, pad: bool = True) -> Any:
        """Warm up twice on a side stream, then capture one graph into `mem_pool`; every row
        padding, or with `pad` False over the inputs loaded for the step about to replay it
        (a step run again over the same inputs writes the same values)."""
        host, buf = self.staging[bs], self.buffers[bs].fit(shape)
        moe = self.expert_pass(bs * shape.num_nodes)
        if pad:
            _pad(buf.inputs(), 0)
            _pad(host, 0)
            self._forget(bs)
        self.models.attention.plan(host["page_table"], host["cache_len"], shape.num_nodes)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-ups: lazy inits, JIT loads, allocator, kernel selection
                spec_step(self.models, self.pool, buf, shape, moe=moe)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        before = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(g, pool=mem_pool):
                spec_step(self.models, self.pool, buf, shape, moe=moe)
        except BaseException:
            # NOTE: a failure inside the capture may leave its stream capturing, or current
            # (torch's exit ends the capture before it restores the stream, and an invalidated
            # capture's end raises): end it, restore the stream, let the device finish.
            if torch.cuda.is_current_stream_capturing():
                with contextlib.suppress(Exception):
                    g.capture_end()
            torch.cuda.set_stream(before)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
            raise
        return g

    def _capture_late(self, bs: int, shape: StepShape) -> Any:
        """The graph of a variant a batch needs first mid-serving (one that adjusts logits or
        reports log-probabilities), captured over the loaded inputs into the graphs' pool.

        NOTE: captured when first needed, not at start: each doubles the graphs of every size
        (four times as many to capture, minutes of start-up), while their activations stay
        within the pool's largest (`graphs.plan --rehearse` measures them). A failure raises a
        `CaptureError` naming the variant, so the scheduler fails that step's rows and goes on;
        no stream is left capturing (`_capture_one`), and the failure is kept: a later step of
        the variant fails at once. Under tensor parallelism the ranks agree first
        (`_peers_failed`): all fail together, and none replays a graph whose collectives its
        peers never join."""
        key = (bs, shape)
        failed = self.capture_failures.get(key)
        if failed is None:
            graph, why = None, None
            t0, m0 = time.perf_counter(), self._reserved()
            try:
                self.mem_pool = self.mem_pool or self._new_pool()
                graph = self._capture_one(bs, shape, self.mem_pool, pad=False)
            except Exception as e:  # noqa: BLE001 - agreed on below, then raised on every rank
                why = f"{type(e).__name__}: {e}"
            failed = self._peers_failed(why)
            if failed is None:
                self.capture_stats[key] = {"seconds": time.perf_counter() - t0,
                                           "bytes": self._reserved() - m0}
                self.graphs[key] = graph
                return graph
            self.capture_failures[key] = failed
        raise CaptureError(
            f"capturing the {shape.mode} step at batch size {bs} that "
            f"{'adjusts logits' if shape.adjust else 'adjusts nothing'} and "
            f"{'reports' if shape.logprobs else 'reports no'} log-probabilities failed while "
            f"serving: {failed}. This step's requests fail; the engine goes on. Graph size is "
            f"set by {self._knobs(bs)}.")

    def _peers_failed(self, why: str | None) -> str | None:
        """Why some rank failed to capture (this one's `why`, else how many peers failed), or
        None when every rank of the tensor-parallel group captured: a sum of failures over
        the ranks, outside any capture."""
        tp = self.models.tp
        if tp is None or tp.world == 1:
            return why
        flag = torch.tensor([int(why is not None)], dtype=torch.int32, device=self.device)
        n = int(tp.all_reduce(flag)[0])
        if not n:
            return None
        return why or f"{n} of {tp.world} tensor-parallel ranks failed to capture it"

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def capture(self, progress: bool = True, lagging: bool = False) -> None:
        """Capture every (batch size, step shape) graph, largest first into one pool (or, when
        compiling, build the steps the batches will most often run, with `lagging` (a server)
        the plain steps of lagging sampled batches too: `CompiledCPUSteps.warm_up_shapes`).

        NOTE: largest first, so the shared pool is sized by the biggest graph and the smaller
        ones reuse its blocks; the warm-ups write only to the dummy page (every row is padding).
        """
        if self.compiled is not None:
            return self._build_compiled(progress, lagging)
        if not self.use_graphs:
            return
        from tqdm import tqdm

        todo = [(bs, s) for bs in sorted(self.capture_sizes, reverse=True)
                for s in self.shapes_of(bs)]
        bs, shape = todo[0]
        with frozen_heap():
            try:
                self.mem_pool = mem_pool = self._new_pool()
                for bs, shape in tqdm(todo, desc="capturing step graphs", disable=not progress):
                    t0, m0 = time.perf_counter(), self._reserved()
                    self.graphs[(bs, shape)] = self._capture_one(bs, shape, mem_pool)
                    self.capture_stats[(bs, shape)] = {
                        "seconds": time.perf_counter() - t0, "bytes": self._reserved() - m0}
            except Exception as e:
                raise CaptureError(
                    f"capturing the {shape.mode} step at batch size {bs} failed: "
                    f"{type(e).__name__}: {e}. Graph size is set by {self._knobs(bs)}; lower "
                    f"one (or leave more GPU memory outside the KV pool) and retry.") from e

    def _build_compiled(self, progress: bool, lagging: bool) -> None:
        from tqdm import tqdm

        compiled = self.compiled
        assert compiled is not None
        todo = compiled.warm_up_shapes(self.shapes, self.capture_sizes, lagging)
        lone_prefill = compiled.prefills([[0, 0]])
        bar = tqdm(total=len(todo) + lone_prefill, desc="compiling steps", disable=not progress)
        what = "a prompt's prefill"
        try:
            for bs, shape in todo:
                what = f"the {shape.mode} step at batch size {bs}"
                t0 = time.perf_counter()
                buf = self.buffers[bs].fit(shape)
                _pad(buf.inputs(), 0)
                self._forget(bs)
                compiled.build(buf, shape)
                self.capture_stats[(bs, shape)] = {"seconds": time.perf_counter() - t0,
                                                   "bytes": 0}
                bar.update()
            what = "a prompt's prefill"
            if compiled.build_prefill():
                bar.update()
        except Exception as e:
            raise CaptureError(f"compiling {what} failed: {type(e).__name__}: {e}. "
                               f"{COMPILE_HINT}") from e
        finally:
            bar.close()

    # ---- model calls ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, inps: Sequence[PrefillInputs]) -> list[int | None]:
        """Fill the caches of each input's `pages` with its `tokens`: those from position 0 all
        in one forward, each later chunk in a forward of its own over its cached prefix
        (`engine.spec.prefill_chunk`); for each with `params`, the next token (drawn with its
        `coin` unless greedy)."""
        rows: dict[int, Tensor] = {}  # input -> its last position's logits, when wanted
        embeds = [self._embeds(inp) for inp in inps]
        head = [i for i, inp in enumerate(inps) if inp.start == 0]
        if head:
            tokens, pages = [inps[i].tokens for i in head], [inps[i].pages for i in head]
            if self.compiled is not None and not any(embeds[i] for i in head):
                logits = self.compiled.prefill(tokens, pages)
            else:
                # NOTE: a prompt with images prefills eagerly: the compiled forward has no
                # rows to put in.
                logits = prefill(self.models, self.pool, tokens, pages,
                                 expert_pass=self.eager_pass, embeds=[embeds[i] for i in head])
            rows.update((i, row) for i, row in zip(head, logits) if inps[i].params is not None)
        for i, inp in enumerate(inps):
            if inp.start > 0:
                row = prefill_chunk(self.models, self.pool, inp.tokens, inp.start, inp.pages,
                                    self.eager_pass,
                                    logits="last" if inp.params is not None else None,
                                    embeds=embeds[i])
                if row is not None:
                    rows[i] = row
        out: list[int | None] = [None] * len(inps)
        self.last_logprobs = [None] * len(inps)
        drawn = {i: self._adjusted(row, inps[i]) for i, row in rows.items()}
        firsts = [self._draw(logits, inps[i].params, inps[i].coin)
                  for i, (logits, _) in drawn.items()]
        tokens = self.read(torch.cat(firsts)) if firsts else []
        for (i, (_, raw)), first, token in zip(drawn.items(), firsts, tokens):
            out[i] = token
            k = inps[i].params.logprobs
            if k is not None:
                lp, vals, ids = token_logprobs(raw[None], first, min(k, raw.shape[-1]))
                self.last_logprobs[i] = [_logprob(token, float(lp[0]), vals[0].tolist(),
                                                  ids[0].tolist(), k)]
        return out

    def _embeds(self, inp: PrefillInputs) -> Embeds | None:
        """The image rows of `inp`'s positions, at their offsets within its tokens."""
        a, n = inp.start, len(inp.tokens)
        offsets: list[int] = []
        rows: list[Tensor] = []
        for pos, image in inp.images:
            lo, hi = max(pos, a), min(pos + image.tokens, a + n)
            if lo >= hi:
                continue
            offsets.extend(range(lo - a, hi - a))
            rows.append(self._image_features(image)[lo - pos:hi - pos])
        return Embeds(offsets, torch.cat(rows)) if rows else None

    def _image_features(self, image: Any) -> Tensor:
        """An image's projected features `[tokens, H]`, encoded once for all the chunks of its
        prompt (the last few images are kept, by content)."""
        vision = self.models.vision
        if vision is None:
            raise ValueError("this model has no vision tower: it cannot take images")
        feats = self._image_cache.pop(image.digest, None)
        if feats is None:
            dev = self.pool.target.device
            with torch.inference_mode():
                feats = vision(image.pixel_values.to(dev), [image.grid])[0]
            if feats.shape[0] != image.tokens:
                raise ValueError(f"image of grid {image.grid} gave {feats.shape[0]} rows, its "
                                 f"prompt holds {image.tokens} tokens")
        self._image_cache[image.digest] = feats
        while len(self._image_cache) > IMAGE_CACHE:
            del self._image_cache[next(iter(self._image_cache))]
        return feats

    def read(self, t: Tensor) -> list[Any]:
        """The one device-to-host copy of a model call's result (`t.tolist()`): a prefill's
        first tokens, a step's decision; the host waits for the device here, and nowhere else
        in a call unless a row asks for log-probabilities or samples its first token with
        top-p (eagerly, the sort reads its promise on the host)."""
        return t.tolist()

    @staticmethod
    def _adjusted(logits: Tensor, inp: PrefillInputs) -> tuple[Tensor, Tensor]:
        """Last-position `logits [V]` with `inp`'s grammar mask and its bias applied, and the
        same without the bias (what log-probabilities are reported from)."""
        p = inp.params
        assert p is not None
        logits = logits.float().clone()
        dev = logits.device
        if inp.mask is not None:
            mask_(logits[None], torch.from_numpy(inp.mask).to(dev)[None])
        raw = logits.clone() if p.logprobs is not None and p.logit_bias else logits
        if p.logit_bias:
            ids, values = zip(*p.logit_bias)
            add_bias_(logits[None, None], torch.tensor([ids], device=dev),
                      torch.tensor([values], device=dev))
        return logits, raw

    @staticmethod
    def _draw(logits: Tensor, p: SamplingParams, coin: float) -> Tensor:
        """The token drawn from `logits [V]` with `p` and uniform `coin`, on the device
        (`[1]`)."""
        if p.greedy:
            return logits.argmax()[None]
        dev, (top_k, top_p) = logits.device, _cut(p)
        probs = target_probs(logits[None], torch.tensor([float(p.temperature)], device=dev),
                             torch.tensor([top_k], device=dev),
                             torch.tensor([float(top_p)], device=dev),
                             **row_promises([(top_k, top_p)], logits.shape[-1]),
                             sort_if_needed=True)
        return sample_from_probs(probs, torch.tensor([coin], device=dev))

    def load(self, inp: StepInputs, pad: bool = False) -> tuple[StepBuffers, StepShape, int]:
        """Copy `inp` into the static buffers. A graph runs its whole captured size (padding
        rows included); an eager step only the batch's rows, unless `pad`. Returns the buffers
        the step reads, its shape, and the page-table width it uses."""
        b = len(inp.anchor)
        if b == 0:
            raise ValueError("a step needs at least one request")
        size, shape = self.padded_size(b), self.step_shape(b, inp.params, inp.lagging)
        fixed = self.use_graphs or self.compiled is not None  # a graph runs its whole size
        p = inp.params
        # NOTE: rows keep their parameters from step to step: staged again (and their cuts
        # worked out, unless the step samples) only when the rows' parameters change
        restage = self._staged_params[size] != p or self._written[size]["temperature"] < b
        cuts = [_cut(x) for x in p] if restage or shape.sample else []
        promise: dict[str, Any] = {}
        if shape.sample:
            # Truncate only the rows that ask for it, and sort the vocabulary only for rows
            # whose cut may not fit in a bounded top-k (eagerly, only when it does not); a
            # compiled step promises for every row or none, so few variants exist; a graph
            # replays its captured sampling variant.
            vocab = self.models.target.cfg.vocab_size
            if self.use_graphs:
                promise = variant_promises(sampling_variant(cuts, vocab), size)
            else:
                promise = row_promises(cuts, vocab)
                if self.compiled is not None:
                    promise = {k: size if v and k != "filtered" else v
                               for k, v in promise.items()}
        adjust = any(x.logit_bias for x in p) or any(m is not None for m in inp.masks)
        logprobs = any(x.logprobs is not None for x in p)
        key = (shape, tuple(promise.items()), not fixed, adjust, logprobs)
        shape = self._step_shapes.get(key) or self._step_shapes.setdefault(key, replace(
            shape, **promise, host_reads=not fixed, adjust=adjust, logprobs=logprobs))
        n = size if (pad or fixed) else b
        buf = self._views.get((size, n, shape)) or self._views.setdefault(
            (size, n, shape), self.buffers[size].rows(n).fit(shape))
        width = self.max_pages
        if not self.use_graphs:
            # Gather only as much context as this batch has (a captured graph needs the full
            # fixed width; a compiled one takes any of 2 pages or more, so gets whole eights:
            # a size of 1 would be a new graph). Eager steps go to the page: each page more is
            # work that reads only padding.
            most = max(map(len, inp.pages))
            width = min(self.max_pages, -(-most // 8) * 8 if self.compiled is not None else most)
        host, hnp = self.staging[size], self._host_np[size]
        written = self._written[size]
        self.page_tables.stage(size, hnp["page_table"], inp.pages, inp.tables)
        S = shape.max_emit
        hnp["anchor"][:b] = inp.anchor
        hnp["cache_len"][:b] = inp.cache_len
        if restage:
            hnp["temperature"][:b] = [1.0 if x.greedy else x.temperature for x in p]
            hnp["top_k"][:b] = [k for k, _ in cuts]
            hnp["top_p"][:b] = [q for _, q in cuts]
            self._staged_params[size] = list(p)
        if shape.sample:  # a greedy step reads no coins
            hnp["coins"][:b, :S] = [c[:S] for c in inp.coins]
        # NOTE: a step that does not adjust reads none of the adjustment buffers, so they are
        # neither staged nor copied: a grammar's mask is ceil(V / 32) words a row.
        keys = [k for k in PADDING if shape.adjust or k not in ADJUST_INPUTS]
        if shape.adjust:
            _stage_adjustments(host, p, inp.masks or [None] * b)
        dsts = self.buffers[size].inputs()
        for k in keys:
            # rows past the batch become padding where the last step wrote them; the device
            # copy (a GPU's) takes the rows either step wrote, the rest being padding already
            hi = max(written[k], b)
            if written[k] > b:
                host[k][b:hi] = PADDING[k]
            written[k] = b
            if dsts[k] is not host[k]:
                dsts[k][:hi].copy_(host[k][:hi], non_blocking=True)
        return buf, shape, width

    def _forget(self, bs: int) -> None:
        """The staging of size `bs` is all padding again (after a capture's warm-ups)."""
        self.page_tables.forget(bs)
        self._written[bs] = dict.fromkeys(PADDING, 0)
        self._staged_params[bs] = []

    def run_loaded(self, buf: StepBuffers, shape: StepShape, width: int) -> None:
        """Run the step over buffers filled by `load` (replay on a GPU, eager elsewhere)."""
        bs = buf.anchor.shape[0]
        if self.models.attention.plans:
            with self.timer("plan"):
                host = self.staging[bs]
                self.models.attention.plan(host["page_table"], host["cache_len"],
                                           shape.num_nodes)
        if self.use_graphs:
            with self.timer("step"):
                graph = self.graphs.get((bs, shape)) or self._capture_late(bs, shape)
                graph.replay()
        elif self.compiled is not None:
            with self.timer("step"):
                self.compiled.run(buf, shape, width)
        else:
            view = replace(buf, page_table=buf.page_table[:, :width])
            spec_step(self.models, self.pool, view, shape, self.timer,
                      moe=self.expert_pass(bs * shape.num_nodes))

    def step(self, inp: StepInputs, pad: bool = False) -> tuple[list[list[int]], list[int]]:
        """Run one step. Returns the emitted tokens and accepted-draft counts per row."""
        b = len(inp.anchor)
        with self.timer("host"):
            buf, shape, width = self.load(inp, pad)
        if shape.drafts and any(inp.lag):
            with self.timer("catch-up"):
                for toks, n, pages in zip(inp.lag, inp.cache_len, inp.pages):
                    if toks:
                        catch_up(self.models, self.pool, toks, n - len(toks), pages,
                                 expert_pass=self.eager_pass)
        self.run_loaded(buf, shape, width)
        with self.timer("host"):
            # NOTE: the only device-to-host copy of a step: the small decision tensors (and
            # the log-probabilities, when some row asks for them).
            out = self.read(torch.cat([buf.accept_len[:b, None], buf.emit[:b]], dim=1))
            accept = [r[0] for r in out]
            emit = [r[1: a + 2] for r, a in zip(out, accept)]
            self.last_logprobs = [None] * b
            if shape.logprobs:
                self._read_logprobs(buf, inp.params, emit)
        return emit, accept

    def _read_logprobs(self, buf: StepBuffers, params: Sequence[SamplingParams],
                       emit: Sequence[Sequence[int]]) -> None:
        """`last_logprobs` of the rows whose `params` ask, from a step's `lp_*` outputs."""
        b = len(params)
        lp = torch.cat([buf.lp_token[:b, :, None], buf.lp_top[:b]], 2).cpu().tolist()
        ids = buf.lp_top_ids[:b].cpu().tolist()
        for r, p in enumerate(params):
            if p.logprobs is not None:
                self.last_logprobs[r] = [_logprob(t, lp[r][j][0], lp[r][j][1:], ids[r][j],
                                                  p.logprobs) for j, t in enumerate(emit[r])]

    @torch.no_grad()
    def prompt_logprobs(self, tokens: Sequence[int], pages: Sequence[int], top: int
                        ) -> list[Logprob | None]:
        """The log-probability of each of `tokens` (a context its `pages` hold in the cache)
        given the ones before it, with its `top` most likely tokens' (None for the first,
        which has no context): `engine.spec.prompt_logprobs`."""
        k = min(top, self.models.target.cfg.vocab_size)
        token, lp, ids = prompt_logprobs(self.models, self.pool, tokens, pages, k,
                                         self.eager_pass)
        return [None] + [_logprob(t, v, vals, i, top) for t, v, vals, i in zip(
            tokens[1:], token.tolist(), lp.tolist(), ids.tolist())]


def sampling_variant(cuts: Sequence[tuple[int, float]], vocab: int, bound: int = TOPK_BOUND
                     ) -> str:
    """The cheapest of `SAMPLING_VARIANTS` exact for rows of these `(top_k, top_p)` (greedy:
    top-k 1; padding rows are greedy and need no entry) at the sampler's `bound`."""
    promise = row_promises(cuts, vocab, bound)
    return "sort" if promise["sort_rows"] else "bounded" if promise["topk_rows"] else "plain"


def variant_promises(variant: str, size: int) -> dict[str, Any]:
    """The `StepShape` promises a sampled graph of `size` rows is captured with in `variant`
    (`ops.sampling.target_probs`: every row or none takes each path, so no row is gathered)."""
    if variant not in SAMPLING_VARIANTS:
        raise ValueError(f"sampling variant must be one of {SAMPLING_VARIANTS}, got {variant!r}")
    return {"filtered": True, "topk_rows": 0 if variant == "plain" else size,
            "sort_rows": size if variant == "sort" else 0}


def _cut(p: SamplingParams) -> tuple[int, float]:
    """A row's `(top_k, top_p)` as the step reads them (top-k off: 0); greedy is top-k 1."""
    return (1, 1.0) if p.greedy else (max(p.top_k, 0), p.top_p)


def _pad(inputs: dict[str, Tensor], start: int) -> None:
    """Rows `start ..` become padding rows."""
    for k, v in PADDING.items():
        inputs[k][start:] = v


def _stage_adjustments(host: dict[str, Tensor], params: Sequence[SamplingParams],
                       masks: Sequence[Any]) -> None:
    """Each row's logit bias (its entries, then zeros), its grammar's mask (every token
    allowed without one), and whether it decodes plainly (it has a grammar), into `host`."""
    b = len(params)
    host["bias_ids"][:b] = 0
    host["bias_values"][:b] = 0.0
    host["allowed"][:b] = -1
    for r, (p, m) in enumerate(zip(params, masks)):
        if p.logit_bias:
            ids, values = zip(*p.logit_bias)
            host["bias_ids"][r, :len(ids)] = torch.tensor(ids)
            host["bias_values"][r, :len(ids)] = torch.tensor(values)
        if m is not None:
            host["allowed"][r] = torch.from_numpy(m)
    host["plain"][:b] = torch.tensor([m is not None for m in masks])
