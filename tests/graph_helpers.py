"""Small engines for the graph-runner tests: a tiny target and drafter, a pool, runners with
the attention backend the engine would pick, prefilled requests, random prompts and sampling
parameters, and pool snapshots (on any device)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import select_backend
from engine.config import SamplingParams
from engine.kv_cache import KVPool, pages_needed
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from engine.request import Request
from engine.runner import StepGraphRunner
from engine.scheduler import Scheduler, next_shape, run_step, step_inputs
from engine.spec import Models, StepShape, spec_step
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
               attention: str | None = None, **kw) -> StepGraphRunner:
    """A runner for the batch sizes `sizes`; with `attention` (an `--attention` value), first
    the backend the engine would choose for every step this runner takes, set on `models`
    (`engine.attention.select_backend`, as `engine.llm.LLM` does)."""
    runner = StepGraphRunner(models, pool, shape, max_batch_size=max(sizes),
                             max_pages=max_pages_for(shape), capture_sizes=sizes, **kw)
    if attention is not None:
        steps = [(bs, s.num_nodes) for bs in runner.capture_sizes for s in runner.shapes_of(bs)]
        models.attention = select_backend(attention, models.target, pool, steps,
                                          runner.max_pages)
    return runner


def prefilled(models: Models, pool: KVPool, shape: StepShape, prompts: list[list[int]],
              params: list[SamplingParams], steps: int = 2,
              runner: StepGraphRunner | None = None) -> list[Request]:
    """Requests whose prompts are prefilled into `pool`, each owning pages for `steps` more
    steps (the first token comes from the prefill), by `runner` (default: a new one for this
    batch) through a scheduler of its own: pages are handed out from the first free one."""
    runner = runner or runner_for(models, pool, shape, [len(prompts)])
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


def random_prompts(n: int, vocab: int = 700) -> list[list[int]]:
    """`n` prompts of 1 to 39 ids below `vocab`, the same for the same `n`."""
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, vocab, (int(n_tok),), generator=g).tolist()
            for n_tok in torch.randint(1, 40, (n,), generator=g)]


def mixed_params(n: int, sample: bool) -> list[SamplingParams]:
    """`n` rows' sampling parameters: greedy, or seeded draws whose temperatures and top-k /
    top-p cuts vary from row to row (none, one or both)."""
    if not sample:
        return [SamplingParams(max_new_tokens=64)] * n
    return [SamplingParams(temperature=0.8 + 0.1 * (i % 3), top_k=[0, 20, 50][i % 3],
                           top_p=[1.0, 0.9, 0.95][i % 3], seed=100 + i) for i in range(n)]


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


def replay_against_eager(runner: StepGraphRunner, reqs: list[Request]
                         ) -> tuple[tuple[torch.Tensor, torch.Tensor, KVPool],
                                    tuple[torch.Tensor, torch.Tensor, KVPool]]:
    """One step of `reqs` run twice from the same cache state over the same loaded inputs
    (sampling: the same coins, loaded once): `runner`'s captured graph replayed (after its
    attention backend planned, as the runner does), then `spec_step` eagerly over the same
    buffers with the kernels the graph holds (experts over aligned blocks). Returns, for each
    run, the emitted tokens `[b, S]`, the accepted lengths `[b]` and the pool after it (the
    second is `runner.pool` itself)."""
    pool, b = runner.pool, len(reqs)
    start = clone_pool(pool)
    buf, shape, width = runner.load(step_inputs(reqs, runner.coins_per_row(b)))
    assert buf.anchor.shape[0] == runner.padded_size(b) and width == runner.max_pages
    runner.run_loaded(buf, shape, width)
    torch.cuda.synchronize()
    replayed = (buf.emit[:b].clone(), buf.accept_len[:b].clone(), clone_pool(pool))
    pool.target.copy_(start.target)
    pool.draft.copy_(start.draft)
    spec_step(runner.models, pool, buf, shape)
    torch.cuda.synchronize()
    return replayed, (buf.emit[:b].clone(), buf.accept_len[:b].clone(), pool)


def request_slots(reqs: list[Request], page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + s for r in reqs for p in r.pages
                         for s in range(page_size)], dtype=torch.int64)


def changed_slots(before: KVPool, after: KVPool) -> set[int]:
    """Flat slots whose target or draft rows differ."""
    diff = (before.target != after.target).flatten(2).any(-1).any(0)
    if before.draft is not None:
        diff |= (before.draft != after.draft).flatten(2).any(-1).any(0)
    return set(diff.nonzero().flatten().tolist())
