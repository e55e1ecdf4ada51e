"""Runs the spec step for a batch of requests: static buffers per batch size, padding rows on the
dummy page, one CUDA graph per (batch size, greedy/sampling) on a GPU, the same step eagerly
elsewhere.

The runner knows nothing of what is inside the step: it copies per-step inputs into the
buffers, replays (or calls) the step, and reads back the small decision tensors.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from engine.kv_cache import DUMMY_PAGE, KVPool
from engine.request import Request
from engine.spec import Models, StepBuffers, StepShape, spec_step


def default_capture_sizes(max_batch_size: int) -> list[int]:
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
    pass


class StepGraphRunner:
    def __init__(
        self, models: Models, pool: KVPool, shape: StepShape, *, max_batch_size: int,
        max_pages: int, capture_sizes: Sequence[int] | None = None, use_graphs: bool | None = None,
        timer: PhaseTimer | None = None,
    ):
        self.models, self.pool = models, pool
        self.shapes = {s: StepShape(shape.mode, shape.budget, shape.block_size, s)
                       for s in (False, True)}
        self.max_pages = max_pages
        self.device = pool.target.device
        self.capture_sizes = sorted(capture_sizes or default_capture_sizes(max_batch_size))
        if self.capture_sizes[-1] < max_batch_size:
            raise ValueError(f"capture sizes {self.capture_sizes} do not reach max_batch_size "
                             f"{max_batch_size}")
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.timer = timer or PhaseTimer()
        self.buffers = {bs: StepBuffers.allocate(bs, max_pages, shape, models.target, self.device)
                        for bs in self.capture_sizes}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}

    @property
    def shape(self) -> StepShape:
        return self.shapes[False]

    def padded_size(self, b: int) -> int:
        for s in self.capture_sizes:
            if s >= b:
                return s
        raise ValueError(f"batch of {b} exceeds the largest captured size "
                         f"{self.capture_sizes[-1]}")

    # ---- capture ---------------------------------------------------------------------------------

    def capture(self, progress: bool = True) -> None:
        """Capture every (batch size, greedy/sampling) graph, largest first into one pool."""
        if not self.use_graphs:
            return
        from tqdm import tqdm

        mem_pool = torch.cuda.graph_pool_handle()
        todo = [(bs, s) for bs in sorted(self.capture_sizes, reverse=True) for s in (False, True)]
        gc.collect()
        gc.freeze()
        try:
            for bs, sample in tqdm(todo, desc="capturing step graphs", disable=not progress):
                buf, shape = self.buffers[bs], self.shapes[sample]
                self._fill_padding(buf, 0)
                try:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # warm-ups: lazy inits, allocator, kernel selection
                            spec_step(self.models, self.pool, buf, shape)
                    torch.cuda.current_stream().wait_stream(stream)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=mem_pool):
                        spec_step(self.models, self.pool, buf, shape)
                    self.graphs[(bs, sample)] = g
                except Exception as e:
                    raise CaptureError(
                        f"capturing the step at batch size {bs} (budget {shape.budget}, mode "
                        f"{shape.mode}) failed: {e}. Lower --max-batch-size or --budget, or "
                        f"the KV memory fraction, and retry.") from e
        finally:
            gc.unfreeze()

    # ---- one step --------------------------------------------------------------------------------

    def _fill_padding(self, buf: StepBuffers, start: int) -> None:
        # NOTE: padding rows have zero context and only the dummy page, so every kernel treats
        # them as ordinary rows while their writes land on the dummy page.
        buf.anchor[start:] = 0
        buf.cache_len[start:] = 0
        buf.page_table[start:] = DUMMY_PAGE
        buf.temperature[start:] = 1.0
        buf.top_k[start:] = 1
        buf.top_p[start:] = 1.0
        buf.coins[start:] = 0.0
        buf.final_coins[start:] = 0.0

    def step(self, reqs: Sequence[Request], pad: bool = True) -> tuple[list[list[int]], list[int]]:
        """Run one step for `reqs` (each must own pages up to `cache_len + S`). Returns the
        emitted tokens and accepted-draft counts per request."""
        b = len(reqs)
        bp = self.padded_size(b) if (pad or self.use_graphs) else b
        full = self.buffers[self.padded_size(b)]
        buf = full.rows(bp)
        N = buf.coins.shape[1]
        sample = any(not r.params.greedy for r in reqs)
        with self.timer("host"):
            width = self.max_pages
            if not self.use_graphs:
                # Eager: gather only as much context as this batch has (a graph needs the
                # full fixed width instead).
                need = max(len(r.pages) for r in reqs)
                width = min(self.max_pages, -(-need // 8) * 8)
            pt = torch.full((b, width), DUMMY_PAGE, dtype=torch.int64)
            for i, r in enumerate(reqs):
                pt[i, :len(r.pages)] = torch.tensor(r.pages[:width])
            coins = torch.stack([r.coins(N + 1) for r in reqs])
            p = [r.params for r in reqs]
            buf.anchor[:b] = torch.tensor([r.anchor for r in reqs])
            buf.cache_len[:b] = torch.tensor([r.cache_len for r in reqs])
            buf.page_table[:b] = DUMMY_PAGE
            buf.page_table[:b, :width] = pt
            buf.temperature[:b] = torch.tensor([x.temperature if not x.greedy else 1.0 for x in p])
            buf.top_k[:b] = torch.tensor([1 if x.greedy else max(x.top_k, 0) for x in p])
            buf.top_p[:b] = torch.tensor([1.0 if x.greedy else x.top_p for x in p])
            buf.coins[:b] = coins[:, :N]
            buf.final_coins[:b] = coins[:, N]
            self._fill_padding(buf, b)
        if self.use_graphs:
            with self.timer("step"):
                self.graphs[(bp, sample)].replay()
        else:
            view = StepBuffers(**{**buf.__dict__, "page_table": buf.page_table[:, :width]})
            spec_step(self.models, self.pool, view, self.shapes[sample], self.timer)
        with self.timer("host"):
            out = torch.cat([buf.accept_len[:b, None], buf.emit[:b]], dim=1).cpu()
        accept = out[:, 0].tolist()
        emit = out[:, 1:].tolist()
        return [e[: a + 1] for e, a in zip(emit, accept)], accept
