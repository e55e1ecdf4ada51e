"""Small engines for the graph-runner tests: a tiny target and drafter, a pool, prefilled
requests, and pool snapshots (on any device)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import SamplingParams
from engine.kv_cache import KVPool, pages_needed
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from engine.request import Request
from engine.runner import StepGraphRunner
from engine.scheduler import Scheduler, next_shape, run_step, step_inputs
from engine.spec import Models, StepShape
from tools.make_draft import make_draft
from tools.make_tiny import make_tiny

BLOCK = 4
PAGE = 4
MAX_LEN = 64


def write_pair(root: Path, block_size: int = BLOCK) -> tuple[Path, Path]:
    t, d = root / "tiny", root / "tiny-dflash"
    if not (t / "config.json").is_file():
        make_tiny(t, dtype="fp32", seed=5)
        make_draft(t, d, layers=1, block_size=block_size, seed=6)
    return t, d


def load_models(target: Path, draft: Path, device: str = "cpu") -> Models:
    tm = KimiForCausalLM.from_dir(target, device, progress=False)
    return Models(tm, DFlashDrafter.from_dir(draft, tm.cfg.hidden_size, device))


def max_pages_for(shape: StepShape) -> int:
    return pages_needed(MAX_LEN + shape.max_emit, PAGE)


def make_pool(models: Models, num_pages: int = 64, device: str = "cpu") -> KVPool:
    return models.kv_pool(PAGE, num_pages, device=device)


def clone_pool(pool: KVPool) -> KVPool:
    return KVPool(pool.page_size, pool.num_pages, pool.target.clone(),
                  None if pool.draft is None else pool.draft.clone())


def runner_for(models: Models, pool: KVPool, shape: StepShape, sizes: list[int],
               **kw) -> StepGraphRunner:
    return StepGraphRunner(models, pool, shape, max_batch_size=max(sizes),
                           max_pages=max_pages_for(shape), capture_sizes=sizes, **kw)


def prefilled(models: Models, pool: KVPool, shape: StepShape, prompts: list[list[int]],
              params: list[SamplingParams], steps: int = 2) -> list[Request]:
    """Requests whose prompts are prefilled into `pool`, each owning pages for `steps` more
    steps (the first token comes from the prefill)."""
    runner = runner_for(models, pool, shape, [len(prompts)])
    sch = Scheduler(runner, num_pages=pool.num_pages, page_size=pool.page_size,
                    vocab_size=models.target.cfg.vocab_size, max_batch_size=len(prompts),
                    max_model_len=MAX_LEN)
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        r = Request(i, list(p), sp)
        r.output_ids += sch.prefill([r])[0]
        sch._grow(r, r.cache_len + steps * shape.max_emit)
        reqs.append(r)
    return reqs


def fresh_copies(reqs: list[Request]) -> list[Request]:
    """Same state and coins (so runs draw equal tokens)."""
    return [r.fork() for r in reqs]


@dataclass
class StepRecord:
    emitted: list[list[list[int]]]
    accepted: list[list[int]]


def step(runner: StepGraphRunner, reqs: list[Request], pad: bool = True, apply: bool = False
         ) -> tuple[list[list[int]], list[int]]:
    """One runner step over `reqs`, with their inputs made as the scheduler makes them; with
    `apply`, its tokens applied to them as the scheduler applies them."""
    if not apply:
        return runner.step(step_inputs(reqs, runner.coins_per_row(len(reqs)),
                                       next_shape(runner, reqs).drafts), pad=pad)
    emitted, accepted = run_step(runner, reqs, pad=pad)
    for r, toks in zip(reqs, emitted):
        r.output_ids += toks
    return emitted, accepted


def run_steps(runner: StepGraphRunner, reqs: list[Request], steps: int,
              pad: bool = True) -> StepRecord:
    """`steps` steps, applying each step's tokens the way the scheduler does."""
    rec = StepRecord([], [])
    for _ in range(steps):
        emitted, accepted = step(runner, reqs, pad, apply=True)
        rec.emitted.append(emitted)
        rec.accepted.append(accepted)
    return rec


def request_slots(reqs: list[Request], page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + s for r in reqs for p in r.pages
                         for s in range(page_size)], dtype=torch.int64)


def changed_slots(before: KVPool, after: KVPool) -> set[int]:
    """Flat slots whose target or draft rows differ."""
    diff = (before.target != after.target).flatten(2).any(-1).any(0)
    if before.draft is not None:
        diff |= (before.draft != after.draft).flatten(2).any(-1).any(0)
    return set(diff.nonzero().flatten().tolist())
