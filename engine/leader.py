"""Tensor parallelism's control plane: rank 0 (the leader) runs the scheduler and, before every
model call, sends the other ranks (the followers) a typed command on the control channel, so
every rank makes the same calls in the same order with the same shapes and the same coins.

Every rank builds the tree and decides from the same gathered logits; rank 0's decision is
still broadcast inside the step (`engine.spec.broadcast_decision`), so floating point can never
make the ranks commit different tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.dist import Group
from engine.runner import CaptureError, Logprob, PrefillInputs, StepGraphRunner, StepInputs


@dataclass
class Prefill:
    inputs: list[PrefillInputs]


@dataclass
class Step:
    inputs: StepInputs
    pad: bool


@dataclass
class PromptLogprobs:
    tokens: list[int]
    pages: list[int]
    top: int


@dataclass
class End:
    """One `generate` call is over; followers return to their caller."""


@dataclass
class Stop:
    """The leader is shutting down; followers leave."""


class AnnouncingRunner:
    """Rank 0's runner: sends each model call to the followers, then makes it."""

    def __init__(self, runner: StepGraphRunner, tp: Group):
        self.inner, self.tp = runner, tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prefill(self, inps: list[PrefillInputs]) -> list[int | None]:
        self.tp.send(Prefill(inps))
        return self.inner.prefill(inps)

    def step(self, inp: StepInputs, pad: bool = False) -> tuple[list[list[int]], list[int]]:
        self.tp.send(Step(inp, pad))
        return self.inner.step(inp, pad)

    def prompt_logprobs(self, tokens: list[int], pages: list[int], top: int
                        ) -> list[Logprob | None]:
        self.tp.send(PromptLogprobs(tokens, pages, top))
        return self.inner.prompt_logprobs(tokens, pages, top)


def follow(tp: Group, runner: StepGraphRunner) -> End | Stop:
    """A follower's loop: make the leader's model calls until it sends `End` or `Stop`."""
    while True:
        cmd = tp.recv()
        if isinstance(cmd, Prefill):
            runner.prefill(cmd.inputs)
        elif isinstance(cmd, Step):
            try:
                runner.step(cmd.inputs, cmd.pad)
            except CaptureError:
                # NOTE: every rank fails a variant's capture together (`StepGraphRunner.
                # _capture_late`); the leader fails the step's rows and asks again
                pass
        elif isinstance(cmd, PromptLogprobs):
            runner.prompt_logprobs(cmd.tokens, cmd.pages, cmd.top)
        elif isinstance(cmd, End | Stop):
            return cmd
        else:
            raise RuntimeError(f"tensor-parallel rank {tp.rank}: unknown command {cmd!r}")
