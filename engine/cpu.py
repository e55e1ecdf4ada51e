"""The CPU's room: everything that exists only to make the step fast on a CPU, which the runner
calls through the same small interface as CUDA graph capture (`CompiledCPUSteps`: `build` a
(batch size, shape) as `_capture_one` captures one, `run` it as a graph replays).

- the compiled step (`--compile on`): `spec_step` compiled whole by inductor with its default
  Python wrapper and the matmul library's GEMMs, one graph per (batch size, step shape), its
  page-table width symbolic; a lone prompt's prefill compiled the same way, its length symbolic;
- inductor's cache kept in the user's cache folder, cleared of libraries a killed compile left;
- the torch threads each compiled step runs on (`ONE_THREAD_ROWS`);
- which expert pass a forward of `n` tokens takes on the CPU, eager (`eager_expert_pass`) and
  compiled (`CompiledCPUSteps.expert_pass`), with the thresholds that choose it;
- the eager step's weight layout (`gemm_layout`).

Nothing else in the engine asks whether it runs compiled: the model layer runs the expert pass
it is given.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from engine.kv_cache import DUMMY_PAGE, KVPool
from engine.models.kimi import KimiForCausalLM
from engine.models.layers import ExpertBank, VocabParallelEmbedding
from engine.spec import (
    ExpertPass,
    Models,
    StepBuffers,
    StepShape,
    prefill,
    prefill_forward,
    spec_step,
)

log = logging.getLogger("engine.cpu")

# A compiled CPU step over at most this many token rows (batch size x tree nodes) is compiled
# for, and runs on, one torch thread; a larger one gets every thread the runner has. A small
# step's ops are too small to share: the matmul library's threads and inductor's parallel loops
# mostly wait for each other (`bench.spec --threads` compares the counts).
ONE_THREAD_ROWS = 8
# An empty kernel library this old in inductor's cache is a killed compile's, not a live link.
STALE_LINK_S = 600.0
# What to do when a compile fails (the runner adds it to its `CaptureError`).
COMPILE_HINT = ("Inductor needs a C++ compiler (g++, or $CXX), and its cache "
                "($TORCHINDUCTOR_CACHE_DIR) may be deleted if a file there is broken; "
                "--compile off runs the step eagerly.")

# ---- the expert pass ---------------------------------------------------------------------------

# Every expert on every token ("dense") beats the pass it would replace on a CPU while that whole
# pass stays under this many multiply-adds: the eager pass ("sparse", grouped for few pairs) and
# the fixed-shape aligned pass ("aligned", whose torch twin gathers each block's expert weights).
# A small bank's launches and weight gathers, not its FLOPs, set the price; a real Kimi expert
# bank never qualifies.
DENSE_MAX_MACS = {"sparse": 1 << 21, "aligned": 1 << 27}
# Inside an inductor compile, a float bank's chosen experts read in place ("indexed",
# `ops.moe.experts_indexed`) beat every expert on every token up to this many (token, expert)
# pairs; past it the other passes take over. Run eagerly that pass would copy every pair's
# expert weights, so only compiled steps take it.
INDEXED_MAX_PAIRS = 768


def dense_is_cheaper(tokens: int, experts: int, hidden: int, inter: int,
                     instead_of: str = "sparse") -> bool:
    """Whether `ops.moe.experts_dense` over `tokens` tokens costs less on a CPU than the pass it
    would replace, `instead_of` "sparse" or "aligned" (`DENSE_MAX_MACS`)."""
    return tokens * experts * 3 * hidden * inter <= DENSE_MAX_MACS[instead_of]


def _dense_is_cheaper(bank: ExpertBank | None, tokens: int, instead_of: str) -> bool:
    """`dense_is_cheaper` for this rank's bank: never for a quantized one (it would dequantize
    whole), always without one (no pass runs)."""
    return bank is None or bank.fmt is None and dense_is_cheaper(
        tokens, bank.num_experts, bank.hidden, bank.inter, instead_of)


def eager_expert_pass(target: KimiForCausalLM) -> ExpertPass:
    """The eager CPU's expert pass for a forward of `n` tokens: each token through its chosen
    experts ("sparse"), or every expert on every token ("dense") where that costs less."""
    bank = target.expert_bank()

    def choose(n: int) -> str:
        return "dense" if _dense_is_cheaper(bank, n, "sparse") else "sparse"

    return choose


def indexed_max_tokens(target: KimiForCausalLM) -> int | None:
    """The most tokens a compiled forward sends through the chosen experts read in place
    (`INDEXED_MAX_PAIRS` pairs of a float bank on the CPU); None where that pass never runs."""
    bank = target.expert_bank()
    if bank is None or bank.fmt is not None or bank.w13.device.type != "cpu":
        return None
    return INDEXED_MAX_PAIRS // target.cfg.num_experts_per_tok


# ---- the eager step's weight layout ------------------------------------------------------------


def column_major(t: Tensor) -> Tensor:
    """`t [..., rows, cols]` with the same values, stored column-major in its last two dims."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def gemm_layout(model: nn.Module) -> None:
    """Store `model`'s float linear weights column-major, in place (the same values): the
    eager CPU step's layout, from which the CPU's GEMM computes most of a step's `x @ W.T`
    faster (`bench.spec` measures it). Only the eager step's: the compiled step's budget table
    was measured with the weights as stored. Weights an embedding shares keep their rows (a
    lookup reads them); quantized ones are not touched."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.is_floating_point() and id(m.weight) not in shared:
            m.weight.data = column_major(m.weight.data)
        elif isinstance(m, ExpertBank) and m.fmt is None:
            # NOTE: w13 column-major as the one `[E * 2I, H]` matrix the dense pass multiplies
            # (its reshape stays a view); w2 per expert, as `bmm` and each expert's linear read it
            E, I2, H = m.w13.shape
            m.w13.data = column_major(m.w13.data.reshape(E * I2, H)).view(E, I2, H)
            m.w2.data = column_major(m.w2.data)


# ---- compiled steps ----------------------------------------------------------------------------


class CompiledCPUSteps:
    """The CPU's step graphs: `spec_step` compiled per (batch size, step shape), a lone prompt's
    prefill compiled once. `threads`: the torch threads of the thread that runs the steps; a
    step takes `threads_for` of them, and is compiled for that count."""

    def __init__(self, models: Models, pool: KVPool, threads: int):
        self.models, self.pool, self.threads = models, pool, threads
        keep_inductor_cache()
        self.built: set[tuple[int, StepShape]] = set()  # the (size, shape)s compiled so far
        self.eager_pass = eager_expert_pass(models.target)
        self.bank = models.target.expert_bank()
        self.indexed_max = indexed_max_tokens(models.target)

    def expert_pass(self, n: int) -> str:
        """The compiled forward's expert pass for `n` tokens: the chosen experts read in place
        up to `indexed_max_tokens`, else the fixed-shape aligned pass, or every expert on every
        token where that costs less."""
        if self.indexed_max is not None and n <= self.indexed_max:
            return "indexed"
        return "dense" if _dense_is_cheaper(self.bank, n, "aligned") else "aligned"

    def threads_for(self, bs: int, shape: StepShape) -> int:
        """The torch threads a step of `shape` at batch size `bs` runs on: one for small steps
        (`ONE_THREAD_ROWS`), else all."""
        return 1 if bs * shape.num_nodes <= ONE_THREAD_ROWS else self.threads

    @staticmethod
    def warm_up_shapes(shapes: Mapping[tuple[int, str], StepShape], sizes: Sequence[int],
                       lagging: bool = False) -> list[tuple[int, StepShape]]:
        """The (size, shape)s to compile before the first step, of the runner's `shapes` by
        (size, step kind): each step the batches will most often run, as `load` promises its
        rows (every row or none), and with `lagging` the plain steps of lagging sampled
        batches too: a server, which must not stall on a compile, warms them up; offline
        they compile if they run, which saves a compile at start for a shape few jobs run."""
        # A sampled step's promises come from its rows: warm up untruncated samplers alone, and
        # beside greedy rows (a mixed batch takes two rows; a sampled one three).
        alone = {"filtered": False, "topk_rows": 0, "sort_rows": 0}
        beside = {"topk_rows": 0, "sort_rows": 0}
        kinds: list[tuple[str, dict[str, Any], int]] = [
            ("greedy", {}, 1), ("sampled", alone, 1), ("sampled", beside, 3),
            ("mixed", beside, 2)]
        if lagging:
            kinds += [("lagging", alone, 1), ("lagging", beside, 3)]
        return list(dict.fromkeys((bs, replace(shapes[(bs, kind)], **promise)) for bs in sizes
                                  for kind, promise, rows in kinds if bs >= rows))

    def build(self, buf: StepBuffers, shape: StepShape) -> None:
        """Compile the step over `buf` (every row padding) for `shape`, as a warm-up."""
        self.run(buf, shape, min(8, buf.page_table.shape[1]))

    def run(self, buf: StepBuffers, shape: StepShape, width: int) -> None:
        """The compiled step over `buf` (every row) with a page table `width` pages wide: one
        graph per (size, shape), its width symbolic (one compile serves every context length),
        compiled for and run on `threads_for` torch threads."""
        import torch._dynamo

        key = (buf.anchor.shape[0], shape)
        # A known key never compiles again (its width is symbolic), so its step skips dynamo's
        # config patch and runs only the guards that tell the graphs apart: the buffers' sizes
        # and the step shape's fields, which fix the key (the full guard walk reads every
        # weight and buffer).
        if key in self.built:
            # NOTE: set_stance takes effect when it is made, not when it is entered
            patch: Any = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        else:
            log.info("compiling the %s step (%s%s) at batch size %d", shape.mode,
                     "" if shape.mode == "ar" else f"budget {shape.budget}, ",
                     "sampled" if shape.sample else "greedy", key[0])
            patch = torch._dynamo.config.patch(automatic_dynamic_shapes=False,
                                               recompile_limit=1 << 12,
                                               accumulated_recompile_limit=1 << 12)
        # NOTE: a contiguous table, so the full width is no other graph than a slice of it
        view = replace(buf, page_table=buf.page_table[:, :width].contiguous())
        torch._dynamo.mark_dynamic(view.page_table, 1)
        moe = self.expert_pass(key[0] * shape.num_nodes)
        with torch.no_grad(), patch, torch_threads(self.threads_for(*key)):
            _compiled_step()(self.models, self.pool, view, shape, moe=moe)
        self.built.add(key)

    def prefills(self, tokens: Sequence[Sequence[int]]) -> bool:
        """Whether a prefill of `tokens` runs compiled: a lone prompt (a batch of them shares
        one eager forward's launches) in a single process, short enough for the compiled
        forward's expert pass: the chosen experts read in place up to `indexed_max_tokens`
        where the bank allows (a longer prompt would compile a second graph), else every expert
        where that costs less than the aligned pass."""
        if self.models.tp is not None or len(tokens) != 1:
            return False
        n = max(len(tokens[0]), 2)
        if self.indexed_max is not None:
            return n <= self.indexed_max
        return _dense_is_cheaper(self.bank, n, "aligned")

    def build_prefill(self) -> bool:
        """Compile the lone prompt's prefill (two tokens on the dummy page), if one ever runs
        compiled; returns whether it did."""
        if not self.prefills([[0, 0]]):
            return False
        self.prefill([[0, 0]], [[DUMMY_PAGE]])
        return True

    def prefill(self, tokens: Sequence[Sequence[int]], pages: Sequence[Sequence[int]]) -> Tensor:
        """`engine.spec.prefill` of `tokens` into `pages` on every thread: through the compiled
        forward where it `prefills` them (one graph serves every length), else eagerly."""
        compiled = self.prefills(tokens)
        with torch_threads(self.threads):
            # NOTE: a compiled prefill may meet a length it has no graph for, so it may trace
            return prefill(self.models, self.pool, tokens, pages,
                           _compiled_prefill() if compiled else None,
                           expert_pass=self.expert_pass if compiled else self.eager_pass)


# Inductor's C++ wrapper: a graph's kernels and the code calling them compile as one C++ unit
# (one compiler run, not one a kernel: cold, the step and the prefill take 40% less CPU to
# compile) and run with no Python between the kernels.
INDUCTOR_OPTIONS = {"cpp_wrapper": True}


@functools.cache
def _compiled_step() -> Callable[..., None]:
    """`spec_step` compiled whole (no graph breaks: `fullgraph`); dynamo keys its graphs by the
    buffers' shapes, the step shape and the expert pass (constants). Run under `no_grad`:
    inference tensors cannot be traced."""
    return torch.compile(inspect.unwrap(spec_step), fullgraph=True, options=INDUCTOR_OPTIONS)


@functools.cache
def _compiled_prefill() -> Callable[..., Any]:
    """The prefill's forward (`engine.spec.prefill_forward`) compiled whole, its length
    symbolic."""
    return torch.compile(prefill_forward, fullgraph=True, options=INDUCTOR_OPTIONS)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """This thread's torch threads set to `n` inside, restored after (the thread team stays)."""
    was = torch.get_num_threads()
    if was == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


# ---- inductor's cache --------------------------------------------------------------------------


def user_cache_dir() -> Path:
    """Where compiled steps are cached: `$XDG_CACHE_HOME/kimi-spec` (else `~/.cache/kimi-spec`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kimi-spec"


def keep_inductor_cache() -> None:
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

