"""Per-request state, kept on the host: plain Python, no torch."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.config import SamplingParams, pages_needed
from engine.grammar import Matcher

if TYPE_CHECKING:
    from engine.runner import Logprob


# Page-table ids, unique in the process (`Request.table`).
_TABLES = itertools.count(1)


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    cache_len: int = 0  # tokens whose KV is committed in the cache
    fed: int = 0  # of those, the tokens whose drafter context is in the cache too
    # Prompt tokens whose KV came from the prefix cache at the request's first admission (a
    # preempted request's later hits are not counted): usage's `cached_tokens`.
    cached_tokens: int = 0
    # The prompt's images: (the position of the image's first placeholder token, the image as
    # `engine.media.Image`), in prompt order.
    images: list[tuple[int, Any]] = field(default_factory=list, repr=False)
    prefix_queried: bool = field(default=False, repr=False)  # admitted once (counted)
    # Where the prefix cache's last insert of its pages stopped (`PrefixCache.insert`).
    cache_cursor: Any = field(default=None, repr=False)
    num_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per step
    finish_reason: str | None = None
    text_end: int | None = None  # where a stop string cut the text, if one did
    # The grammar's state after the output so far, when the params have a grammar (made when
    # the scheduler checks the request).
    matcher: Matcher | None = field(default=None, repr=False)
    # When the params ask: each output token's log-probabilities, and each prompt token's
    # (None for the first), once the prompt is cached.
    logprobs: list[Logprob] | None = field(default=None, repr=False)
    prompt_logprobs: list[Logprob | None] | None = field(default=None, repr=False)
    # The output's text as the scheduler decoded it (`decoded`): its parts, a step's text each,
    # joined only when read, so a step's work does not grow with the text; its length; and its
    # last `stop_hold` characters, where a stop string reaching into the next step's text may
    # begin (its longest stop string's length - 1).
    text_parts: list[str] = field(default_factory=list, repr=False)
    text_len: int = 0
    text_tail: str = field(default="", repr=False)
    stop_hold: int = field(init=False, repr=False)
    # The last step's tokens' pieces of it (`engine.scheduler.StepEvent.pieces`), and the
    # decoder that holds a character split across tokens (`engine.scheduler.TextDecoder`).
    new_pieces: list[str] | None = field(default=None, repr=False)
    text_decoder: Any = field(default=None, repr=False)
    rng: random.Random = field(init=False, repr=False)
    drawn: list[float] = field(init=False, repr=False)  # coins of output positions 0, 1, ...
    # Names `pages` for the runner while the list only grows (`StepInputs.tables`); a new one
    # once the pages are given back (`new_table`).
    table: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # NOTE: one stream per request, so a seeded request draws the same coins whatever
        # else shares its batch.
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.rng = random.Random(seed)
        self.drawn = []
        self.table = next(_TABLES)
        self.stop_hold = max(map(len, self.params.stop), default=1) - 1
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []

    def new_table(self) -> None:
        """Its pages were given back: the next ones are another table."""
        self.table = next(_TABLES)

    @property
    def anchor(self) -> int:
        """The last emitted token: the root of the next tree, not yet in the cache."""
        return self.output_ids[-1]

    @property
    def decoded(self) -> str:
        """The output's text as the scheduler decoded it (its parts joined once, when read)."""
        parts = self.text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self) -> Request:
        """The same tokens, pages, cache length and coins (so two runs from one state draw
        equal tokens)."""
        c = Request(self.rid, list(self.prompt_ids), self.params)
        c.output_ids, c.pages = list(self.output_ids), list(self.pages)
        c.cache_len, c.fed = self.cache_len, self.fed
        c.rng.setstate(self.rng.getstate())
        c.drawn = list(self.drawn)
        c.matcher = self.matcher.copy() if self.matcher is not None else None
        if self.logprobs is not None:
            c.logprobs = list(self.logprobs)
        return c

    def coins(self, n: int) -> list[float]:
        """The uniforms in [0, 1) of the next `n` output positions, from `len(output_ids)` on
        (zeros when greedy). Each position has one coin, the request stream's draw number
        `position`, whichever step reads it and however often: the token at a position is drawn
        with its coin in every mode, so a seeded request emits the same tokens with or without
        drafts.
        NOTE: 24 random bits each, so every value is exact in float32 and below 1 there too."""
        if self.params.greedy:
            return [0.0] * n
        start = len(self.output_ids)
        while len(self.drawn) < start + n:
            self.drawn.append(self.rng.getrandbits(24) / (1 << 24))
        return self.drawn[start:start + n]


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool); `param` names
    the field at fault when it is not the prompt."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What every request is checked against before it queues (`check`), fixed when the
    engine starts: a server's frontend process checks with a copy, as the scheduler does."""

    max_model_len: int
    page_size: int
    capacity: int  # usable KV pages
    step_span: int
    vocab_size: int

    def check(self, req: Request) -> None:
        """Raises RequestRejected when `req` can never run (its grammar is checked apart)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        if n + 1 > self.max_model_len:
            raise RequestRejected(f"the prompt has {n} tokens; the context limit is "
                                  f"{self.max_model_len} (--max-model-len: prompt plus at "
                                  f"least one new token)")
        need = pages_needed(min(n + req.params.max_new_tokens, self.max_model_len)
                            + self.step_span, self.page_size)
        if need > self.capacity:
            raise RequestRejected(
                f"the request needs {need} KV pages ({need * self.page_size} tokens with the "
                f"step's span), the whole pool has {self.capacity} (--kv-pages, or "
                f"sized by --gpu-memory-utilization / --cpu-memory-budget)")
        vocab = self.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary "
                                  f"[0, {vocab})")
        bad = [t for t, _ in req.params.logit_bias if not t < vocab]
        if bad:
            raise RequestRejected(f"logit_bias token id {bad[0]} is outside the vocabulary "
                                  f"[0, {vocab})", "logit_bias")
