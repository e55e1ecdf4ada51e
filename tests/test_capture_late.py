"""A step variant captured while serving (`StepGraphRunner._capture_late`: one that reports
log-probabilities or adjusts logits) that fails to capture: the step's rows fail with a
`CaptureError` that names the variant, the scheduler (`isolate`, as the server runs it) fails
only the rows that need it and goes on, the failure is kept (never captured again), and under
tensor parallelism a peer's failure fails every rank (and a follower goes on). No GPU: the
runner's capture is a fake that replays the step eagerly, or raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import leader
from engine.config import SamplingParams
from engine.request import Request
from engine.runner import CaptureError
from engine.scheduler import Scheduler
from engine.spec import StepShape, spec_step
from tests.graph_helpers import BLOCK, MAX_LEN, load_models, make_pool, runner_for, write_pair


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_models(*write_pair(tmp_path_factory.mktemp("late")))


class _Eager:
    """A captured graph's stand-in: its replay runs the step eagerly over the same buffers."""

    def __init__(self, runner, bs: int, shape: StepShape):
        self.runner, self.bs, self.shape = runner, bs, shape

    def replay(self) -> None:
        r = self.runner
        spec_step(r.models, r.pool, r.buffers[self.bs].fit(self.shape), self.shape,
                  moe=r.expert_pass(self.bs * self.shape.num_nodes))


def _runner(models, monkeypatch, fails):
    """A CPU runner that runs as with graphs, each (batch size, shape) captured on first use
    (none at start); `fails(shape)` says which captures raise. Returns it and its captures."""
    runner = runner_for(models, make_pool(models), StepShape("tree", 4, BLOCK, False), [1, 2])
    runner.use_graphs = True
    tries: list[tuple[int, StepShape]] = []

    def capture_one(bs, shape, mem_pool, pad=True):
        tries.append((bs, shape))
        if fails(shape):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _Eager(runner, bs, shape)

    monkeypatch.setattr(runner, "_capture_one", capture_one)
    monkeypatch.setattr(runner, "_new_pool", lambda: object())
    return runner, tries


def test_a_failed_capture_fails_its_rows_and_the_engine_goes_on(models, monkeypatch):
    runner, tries = _runner(models, monkeypatch, lambda shape: shape.logprobs)
    s = Scheduler(runner, num_pages=64, page_size=4, vocab_size=models.target.cfg.vocab_size,
                  max_batch_size=2, max_model_len=MAX_LEN)
    s.isolate = True
    plain = Request(0, [3, 4, 5, 6], SamplingParams(max_new_tokens=6))
    asks = Request(1, [7, 8, 9], SamplingParams(max_new_tokens=6, logprobs=2))
    s.add(plain)
    s.add(asks)
    events = []
    for _ in range(30):
        if not s.has_work:
            break
        events += s.step()
    assert not s.has_work
    assert plain.finish_reason == "length" and len(plain.output_ids) == 6
    assert asks.finish_reason == "error" and not asks.pages
    (failed,) = [e for e in events if e.error is not None]
    assert failed.req is asks and isinstance(failed.error, CaptureError)
    msg = str(failed.error)
    assert "reports log-probabilities" in msg and "OutOfMemoryError" in msg
    assert "--max-batch-size" in msg and "the engine goes on" in msg
    # each failed variant was tried once: the batch of both, then the asking row alone
    bad = [(bs, sh) for bs, sh in tries if sh.logprobs]
    assert len(bad) == len(set(bad)) == 2 and set(runner.capture_failures) == set(bad)
    assert all(key not in runner.graphs for key in bad)
    # the plain row's variants were captured and kept
    assert any(bs == 1 and not sh.logprobs for bs, sh in runner.graphs)


def test_a_kept_failure_raises_without_capturing_again(models, monkeypatch):
    runner, tries = _runner(models, monkeypatch, lambda shape: True)
    shape = runner.shapes[(1, "greedy")]
    for _ in range(2):
        with pytest.raises(CaptureError, match="failed while serving: OutOfMemoryError"):
            runner._capture_late(1, shape)
    assert tries == [(1, shape)]


def test_under_tensor_parallelism_a_peers_failure_fails_every_rank(models, monkeypatch):
    runner, tries = _runner(models, monkeypatch, lambda shape: False)
    sums: list[int] = []

    def all_reduce(t):  # one peer of three failed
        sums.append(int(t[0]))
        return t + 1

    monkeypatch.setattr(runner.models, "tp", SimpleNamespace(world=3, all_reduce=all_reduce))
    shape = runner.shapes[(2, "greedy")]
    with pytest.raises(CaptureError, match="1 of 3 tensor-parallel ranks failed"):
        runner._capture_late(2, shape)
    assert sums == [0] and (2, shape) not in runner.graphs  # this rank captured; not kept
    # a follower whose step fails to capture goes on to the leader's next command
    cmds = iter([leader.Step(None, False), leader.Stop()])
    tp = SimpleNamespace(rank=1, recv=lambda: next(cmds))

    def step(inp, pad):
        raise CaptureError("capturing failed while serving")

    assert isinstance(leader.follow(tp, SimpleNamespace(step=step)), leader.Stop)
