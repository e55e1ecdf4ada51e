"""Continuous batching of speculative steps, in plain Python (no torch).

Each `step()` prefills up to `prefill_chunk` prompt tokens (chunked prefill, as vLLM's): first
the next chunk of each prompt already being prefilled, then waiting requests, several short
ones in one forward or the first chunk of a long one; a prompt's last chunk gives its first
token and moves it to the running batch. It then makes sure every running request owns pages
for what the next step may write (preempting the newest when the pool runs dry: a prompt being
prefilled first), runs one spec step for the whole running batch, and applies the emitted
tokens with stop checks on the host. So a long prompt prefills over several engine steps while
the running requests keep emitting. Finished requests leave at once and free their pages.

With the prefix cache (`engine.prefix_cache`), a waiting request is admitted over the cached pages
its context starts with and prefills only the rest; each prefill chunk's whole pages, and a
request's committed pages when it ends or is preempted, go into the cache; cached pages no
request holds count as free for admission and are evicted, least recently used first, before any
request is preempted.

Every model call goes through the runner (`engine.runner.StepGraphRunner`, or anything with its
`prefill`, `step`, `coins_per_row`, `step_shape` and `shape`, and `last_logprobs` and
`prompt_logprobs` once a request asks for log-probabilities), which takes host values, not
requests. A request with a grammar (`engine.grammar`) hands each model call the mask of its next
token and decodes plainly (one token a step); `_apply` advances its grammar with every token it
keeps, and ends it when the grammar is complete. With `isolate` set (the server), a model
call that raises is run again row by row: a row that fails alone finishes with reason "error",
the rest go on as if nothing happened.
A plain-decoding step (budget 0) leaves the drafter's cache behind; the request's next
drafting step brings it the tokens it missed (`lag`), unless most rows sample: such a batch with
a lagging row keeps decoding plainly (the runner's "lagging" kind).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.grammar import GrammarError, Grammars
from engine.kv_cache import BlockAllocator, OutOfPages, pages_needed
from engine.prefix_cache import PrefixCache, image_keys
from engine.request import Limits, Request, RequestRejected
from engine.runner import Logprob, PrefillInputs, StepInputs


def _context(req: Request) -> list[int]:
    """The tokens a request's prefill writes: its whole sequence when fresh (its first token
    comes from the prefill), else all but the last (the next step's anchor)."""
    seq = req.prompt_ids + req.output_ids
    return seq if not req.output_ids else seq[:-1]


class TextDecoder(Protocol):
    """Output text decoded as tokens come (`engine.tokenizer.IncrementalDecoder`): `pieces`
    gives the text each id completes (a character split across ids comes with its last;
    special ids leave none), `flush` what a split character left (as a whole decode shows
    it)."""

    def pieces(self, ids: Sequence[int]) -> list[str]: ...

    def flush(self) -> str: ...


def find_stop(text: str, new_from: int, stops: Sequence[str]) -> int | None:
    """Where the first of `stops` begins in `text`, given that none did in `text[:new_from]`
    (earlier steps looked): only a match reaching past `new_from` is searched for."""
    hits = [i for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
    return min(hits) if hits else None


@dataclass
class StepEvent:
    """What one request got from one engine step: new tokens, whether it ended (its
    `finish_reason` says why), and the tokens its spec step emitted (0 for a prefill)."""

    req: Request
    new_ids: list[int]
    finished: bool
    emitted: int = 0
    # Why the request failed (finish_reason "error"), and whether it failed alone while other
    # rows of the same call ran (blamed) or with every row of it (the cause is unknown).
    error: BaseException | None = None
    blamed: bool = False
    # The new tokens' log-probabilities, when the request asks (from its `logprobs`).
    logprobs: list[Logprob] | None = None
    # The new tokens' text when the scheduler decodes (`Scheduler.decoder`): a piece each
    # (special ids: ""; a character split across tokens comes with its last), and on the
    # request's last event one more, what a character left split shows as (a whole decode's
    # replacement character, or "").
    pieces: list[str] | None = None

    def __post_init__(self) -> None:
        lp = self.req.logprobs
        if self.logprobs is None and lp is not None:
            self.logprobs = lp[len(lp) - len(self.new_ids):]
        if self.pieces is None:
            self.pieces = self.req.new_pieces


def lagging(reqs: Sequence[Request]) -> bool:
    """Whether some request's drafter cache lacks committed tokens (plain steps left it)."""
    return any(r.fed < r.cache_len for r in reqs)


def next_shape(runner: Any, reqs: Sequence[Request]) -> Any:
    """The shape of the runner's next step over `reqs` (`StepGraphRunner.step_shape`)."""
    return runner.step_shape(len(reqs), [r.params for r in reqs], lagging(reqs))


def run_step(runner: Any, reqs: Sequence[Request], drafts: bool | None = None, pad: bool = False
             ) -> tuple[list[list[int]], list[int]]:
    """One runner step over `reqs` (one that `drafts`, by default as its shape says, also brings
    each drafter cache the tokens it lacks), with each request's cache length advanced past what
    it committed and, when the step drafted, its drafter cache marked fed; the emitted tokens are
    the caller's to apply. Returns the emitted tokens and the accepted-draft counts per row."""
    if drafts is None:
        drafts = next_shape(runner, reqs).drafts
    emitted, accepted = runner.step(
        step_inputs(reqs, runner.coins_per_row(len(reqs)), drafts), pad=pad)
    for req, acc in zip(reqs, accepted):
        req.cache_len += acc + 1
        if drafts:
            req.fed = req.cache_len
    return emitted, accepted


def step_inputs(reqs: Sequence[Request], coins_per_row: int, drafts: bool = False
                ) -> StepInputs:
    """What a step needs of `reqs`, each with the coins of its next `coins_per_row` output
    positions; a step that `drafts` also takes the committed tokens each drafter cache lacks."""
    lag = [(r.prompt_ids + r.output_ids)[r.fed:r.cache_len] if r.fed < r.cache_len else []
           for r in reqs] if drafts else []
    masks = [r.matcher.mask() if r.matcher is not None else None for r in reqs]
    # NOTE: each request's own page list, not a copy: the runner reads it within the call
    # and writes only the pages added since its table id was last staged
    return StepInputs([r.anchor for r in reqs], [r.cache_len for r in reqs],
                      [r.pages for r in reqs], [r.params for r in reqs],
                      [r.coins(coins_per_row) for r in reqs], lag, lagging(reqs),
                      masks if any(m is not None for m in masks) else [],
                      [r.table for r in reqs])


class Scheduler:
    def __init__(self, runner: Any, *, num_pages: int, page_size: int, vocab_size: int,
                 max_batch_size: int, max_model_len: int, stop_ids: frozenset[int] = frozenset(),
                 decoder: Callable[[], TextDecoder] | None = None, prefill_chunk: int = 2048,
                 grammars: Grammars | None = None, prefix_caching: bool = True):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.runner = runner
        # The most prompt tokens one step prefills (each of several short prompts padded to
        # the longest of them).
        self.prefill_chunk = prefill_chunk
        self.page_size, self.vocab_size = page_size, vocab_size
        self.alloc = BlockAllocator(num_pages, reserved=1)
        # Whole pages of committed tokens kept for later requests (`engine.prefix_cache`): a
        # request admitted over a cached prefix prefills only the rest. Its counters, in tokens
        # of first admissions (as vLLM's): prompt tokens looked up, and found.
        self.cache = PrefixCache(self.alloc, page_size, prefix_caching)
        self.prefix_queries = self.prefix_hits = 0
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.stop_ids = stop_ids
        # A fresh decoder of a request's output text: each token is decoded once, here, into
        # the request's `pieces` (which its stream and its final text read) and `decoded`
        # text (where its stop strings are looked for).
        self.decoder = decoder
        self.grammars = grammars  # matchers of requests with a grammar (None: no tokenizer)
        self.waiting: deque[Request] = deque()
        # Admitted, their pages held, their prompts partly prefilled (`cache_len` of them).
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Fault isolation (see the module docstring); exceptions of the `fatal` types (a lost
        # tensor-parallel peer) are never retried: they propagate.
        self.isolate = False
        self.fatal: tuple[type[BaseException], ...] = ()
        # The most any step writes past cache_len: the root plus every accepted node. Admission
        # keeps room for it; each step reserves only what its own shape can write, so a row's
        # page table (and the context its attention reads) stays as short as the step allows.
        self.step_span = runner.shape.max_emit
        self.limits = Limits(max_model_len, page_size, self.alloc.capacity, self.step_span,
                             vocab_size)

    # ---- admission -------------------------------------------------------------------------------

    def check(self, req: Request) -> None:
        self.limits.check(req)
        if req.images and req.params.prompt_logprobs is not None:
            # NOTE: the prompt's log-probabilities run over its cache again, without its images
            raise RequestRejected("prompt_logprobs is not supported for prompts with images",
                                  "prompt_logprobs")
        if req.params.grammar is not None and req.matcher is None:
            # NOTE: the matcher is made here, once, so a grammar that cannot compile is
            # refused with the request (it touches no scheduler state).
            if self.grammars is None:
                raise RequestRejected("a grammar needs the model's tokenizer, and it has none")
            try:
                req.matcher = self.grammars.matcher(req.params.grammar)
            except GrammarError as e:
                raise RequestRejected(f"the grammar cannot be used: {e}") from e

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def abort(self, req: Request) -> None:
        self._drop(req)
        self._release(req)
        req.finish_reason = req.finish_reason or "abort"

    def _drop(self, req: Request) -> None:
        """`req` leaves whichever queue holds it."""
        for queue in (self.running, self.prefilling, self.waiting):
            if req in queue:
                queue.remove(req)
                return

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def admitted(self) -> int:
        """Requests holding a batch slot: running, or being prefilled."""
        return len(self.running) + len(self.prefilling)

    def _release(self, req: Request, keep: bool = True) -> None:
        """`req`'s pages go back: with `keep`, its committed whole pages into the prefix cache
        first (a failed request's are not kept)."""
        if req.pages:
            if keep:
                self._insert(req)
            self.cache.release(req.pages)
            req.pages = []
            req.new_table()
        req.cache_len = req.fed = 0
        req.cache_cursor = None

    def _insert(self, req: Request) -> None:
        """`req`'s whole pages committed in both caches (below `min(cache_len, fed)`) into the
        prefix cache, from where its last insert stopped."""
        req.cache_cursor = self.cache.insert(
            req.prompt_ids + req.output_ids, req.pages, req.params.cache_salt,
            min(req.cache_len, req.fed), req.cache_cursor,
            image_keys(req.images, self.page_size))

    def _grow(self, req: Request, num_tokens: int) -> None:
        extra = pages_needed(num_tokens, self.page_size) - len(req.pages)
        if extra > 0:
            req.pages += self.cache.alloc_pages(extra)

    def _hit(self, req: Request, ctx: list[int]) -> list[int]:
        """The cached pages a waiting request's context `ctx` starts with (`_hittable` at
        most)."""
        return self.cache.match(ctx, req.params.cache_salt,
                                self._hittable(req, len(ctx)) * self.page_size,
                                image_keys(req.images, self.page_size))

    def _hittable(self, req: Request, ctx: int) -> int:
        """The most pages of a context of `ctx` tokens a waiting request may hit (none without
        the cache): a fresh request's last prompt token is always computed again (its logits
        give the first token); a recomputed one samples nothing, so all of its context may."""
        if not self.cache.enabled:
            return 0
        return (ctx - 1 if not req.output_ids else ctx) // self.page_size

    def _admit(self, req: Request, hit: list[int], ctx: int) -> None:
        """`req` holds the pages of its cached prefix `hit` and new ones for the rest of its
        context `ctx`; its prefill starts past the hit."""
        self.cache.hold(hit)
        req.pages = list(hit)
        req.cache_len = req.fed = len(hit) * self.page_size
        self._grow(req, ctx)
        if not req.prefix_queried:  # first admission: what usage and the counters report
            req.prefix_queried = True
            req.cached_tokens = req.cache_len
            if self.cache.enabled:
                self.prefix_queries += len(req.prompt_ids)
                self.prefix_hits += req.cache_len

    # ---- prefill ---------------------------------------------------------------------------------

    def prefill(self, reqs: Sequence[Request]) -> list[list[int]]:
        """Fill the caches for each request's whole sequence, all in one forward, and return
        each one's new tokens (the first sampled token for a fresh request, nothing for a
        recomputed one)."""
        for req in reqs:
            self._grow(req, len(_context(req)))
        return [new for new, _ in self._prefill([(req, len(_context(req))) for req in reqs])]

    def _prefill(self, pieces: Sequence[tuple[Request, int]]
                 ) -> list[tuple[list[int], list[Logprob] | None]]:
        """One runner call that prefills, for each `(request, n)`, the next `n` tokens of its
        context after the `cache_len` already cached (its pages held); returns each one's new
        tokens: the first sampled token of a fresh request whose context this completes,
        else nothing; and their log-probabilities when it asks. A fresh request that asks for
        its prompt's log-probabilities gets them once its prompt is cached. Cache lengths
        advance only once the call returned."""
        inps, fresh = [], []
        ran = [(req, n) for req, n in pieces if n > 0]  # NOTE: 0: a context all cached
        for req, n in ran:
            ctx, start = _context(req), req.cache_len
            first = not req.output_ids and start + n == len(ctx)
            mask = req.matcher.mask() if first and req.matcher is not None else None
            images = [(p, im) for p, im in req.images if p < start + n and p + im.tokens > start]
            inps.append(PrefillInputs(ctx[start:start + n], list(req.pages),
                                      req.params if first else None,
                                      req.coins(1)[0] if first else 0.0, start, mask, images))
            fresh.append(first)
        firsts = self.runner.prefill(inps) if inps else []
        lps = (self.runner.last_logprobs if any(
            f and r.params.logprobs is not None for (r, _), f in zip(ran, fresh))
            else [None] * len(ran))
        prompt_lps = [self.runner.prompt_logprobs(req.prompt_ids, list(req.pages), top)
                      if first and (top := req.params.prompt_logprobs) is not None else None
                      for (req, _), first in zip(ran, fresh)]
        out = {id(req): ([] if f is None else [f], lp) for (req, _), f, lp in zip(ran, firsts, lps)}
        for (req, n), prompt_lp in zip(ran, prompt_lps):
            req.cache_len = req.fed = req.cache_len + n
            if prompt_lp is not None:
                req.prompt_logprobs = prompt_lp
            self._insert(req)  # NOTE: each chunk's pages, shared from the next step on
        return [out.get(id(req), ([], None)) for req, _ in pieces]

    def _logprobs(self, reqs: Sequence[Request]) -> list[list[Logprob] | None]:
        """The log-probabilities of the runner's last step over `reqs`, per row."""
        if any(r.params.logprobs is not None for r in reqs):
            return self.runner.last_logprobs
        return [None] * len(reqs)

    # ---- host-side token handling ------------------------------------------------------------

    def _apply(self, req: Request, tokens: list[int],
               logprobs: Sequence[Logprob] | None = None) -> list[int]:
        """Append `tokens` (with their `logprobs`, when the request asks) with stop checks,
        advancing the request's grammar; returns the tokens actually kept. A grammar that is
        complete (only an end token may follow) stops the request."""
        p = req.params
        # Up to the first stop id (unless ignored), which ends the request, and at most what
        # the length limits leave, the last of which ends it too.
        n = len(tokens)
        stop = n if p.ignore_eos or self.stop_ids.isdisjoint(tokens) else next(
            j for j, t in enumerate(tokens) if t in self.stop_ids)
        room = min(p.max_new_tokens - len(req.output_ids),
                   self.max_model_len - len(req.prompt_ids) - len(req.output_ids))
        kept = tokens[:min(stop, room)]
        if req.matcher is not None:  # a complete grammar ends the request at its token
            for j, t in enumerate(kept):
                req.matcher.consume(t)
                if req.matcher.done:
                    kept = kept[:j + 1]
                    req.finish_reason = "stop"
                    break
        req.output_ids += kept
        if req.logprobs is not None and logprobs is not None:
            req.logprobs += logprobs[:len(kept)]
        if req.finish_reason is None:
            if stop < min(n, room):
                req.finish_reason = "stop"
            elif room <= n:
                req.finish_reason = "length"
        if self.decoder is not None:
            self._decode(req, kept)
        return kept

    def _decode(self, req: Request, kept: list[int]) -> None:
        """`kept`'s text onto the request's text (`Request.decoded`), a piece a token
        (`new_pieces`), each token decoded once (the rest of a split character too, when the
        request ended), and its stop strings looked for where a match reaches into what is new:
        in the text's tail (`Request.text_tail`) and the new text, so a step's work does not
        grow with the text."""
        assert self.decoder is not None
        if req.text_decoder is None:  # the request's first tokens (or a copy's)
            req.text_decoder = self.decoder()
            earlier = req.output_ids[:len(req.output_ids) - len(kept)]
            text = "".join(req.text_decoder.pieces(earlier))
            req.text_parts, req.text_len = [text], len(text)
            req.text_tail = text[max(0, len(text) - req.stop_hold):]
        new = req.text_decoder.pieces(kept)
        text = "".join(new)
        stops = req.params.stop
        if text and stops:
            tail = req.text_tail
            window = tail + text
            for s in stops:
                if s in window:  # NOTE: most steps' text holds none: no search for where
                    cut = find_stop(window, len(tail), stops)
                    if cut is not None:
                        req.text_end = req.text_len - len(tail) + cut
                        req.finish_reason = "stop"
                    break
            req.text_tail = window[max(0, len(window) - req.stop_hold):]
        if req.finished:
            new.append(req.text_decoder.flush())
            text += new[-1]
        if text:
            req.text_parts.append(text)
            req.text_len += len(text)
        req.new_pieces = new

    def _reserve(self, span: int) -> bool:
        """Pages for `span` tokens past each running request's cache; when the pool runs dry,
        the newest prompt being prefilled (else the newest running request) goes back to the
        queue and False is returned."""
        size = self.page_size
        for req in self.running:
            if len(req.pages) * size >= req.cache_len + span:
                continue  # NOTE: most rows most steps: the pages they hold suffice
            try:
                self._grow(req, req.cache_len + span)
            except OutOfPages:
                self._preempt((self.prefilling or self.running)[-1])
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """`req` leaves the batch (or its prefill) for the front of the queue, its pages
        freed."""
        self._drop(req)
        self._release(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- one engine step -----------------------------------------------------------------------

    def _pieces(self) -> list[tuple[Request, int]]:
        """What this step prefills, at most `prefill_chunk` tokens in all: the next chunk of
        each prompt being prefilled (oldest first), then waiting requests while the batch and
        the pool have room: whole contexts together (each padded to the longest), or, first
        in line and longer than what is left, a long one's first chunk. Admitted requests hold
        the pages of their whole context from here on."""
        left = self.prefill_chunk
        pieces: list[tuple[Request, int]] = []
        for req in self.prefilling:
            if left <= 0:
                break
            n = min(len(_context(req)) - req.cache_len, left)
            pieces.append((req, n))
            left -= n
        admit: list[Request] = []
        longest = 0
        while left > 0 and self.waiting and self.admitted + len(admit) < self.max_batch_size:
            req = self.waiting[0]
            seq_len = len(req.prompt_ids) + len(req.output_ids)
            ctx_ids = _context(req)
            ctx = len(ctx_ids)
            hit = self._hit(req, ctx_ids)
            if len(hit) < self._hittable(req, ctx) and any(
                    r.prompt_ids == req.prompt_ids and r.params.cache_salt == req.params.cache_salt
                    for r in (*self.prefilling, *admit)):
                break  # NOTE: the same prompt is being prefilled (n choices): it hits next step
            # room: free pages and evictable cached ones, less those of the hit (held, they
            # cannot be evicted)
            if (pages_needed(seq_len + self.step_span, self.page_size) - len(hit)
                    > self.cache.room_with(hit)):
                break
            todo = ctx - len(hit) * self.page_size  # what its prefill computes
            if admit and (len(admit) + 1) * max(longest, todo) > left:
                break
            self.waiting.popleft()
            self._admit(req, hit, ctx)  # its pages count against the next admission
            admit.append(req)
            longest = max(longest, todo)
            pieces.append((req, min(todo, left)))
            if todo > left:  # a long prompt's first chunk: alone, the rest in later steps
                break
        return pieces

    def step(self) -> list[StepEvent]:
        events: list[StepEvent] = []
        # 1. prefill: the next chunks of prompts being prefilled, and new requests
        pieces = self._pieces()
        try:
            firsts: list[tuple[list[int], list[Logprob] | None] | BaseException] = (
                list(self._prefill(pieces)) if pieces else [])
        except Exception as e:  # noqa: BLE001 - isolated below, or raised again
            size = {id(r): n for r, n in pieces}
            firsts = self._one_by_one([r for r, _ in pieces], e,
                                      lambda r: self._prefill([(r, size[id(r)])])[0])
        blamed = any(not isinstance(f, BaseException) for f in firsts)
        for (req, _), new in zip(pieces, firsts):
            if isinstance(new, BaseException):
                events.append(self._failed(req, new, blamed))
                continue
            if req.cache_len < len(_context(req)):
                if req not in self.prefilling:
                    self.prefilling.append(req)
                continue
            if req in self.prefilling:
                self.prefilling.remove(req)
            kept = self._applied(req, *new, events)
            if kept is None:
                continue
            if req.finished:
                self._release(req)
                events.append(StepEvent(req, kept, True))
                continue
            self.running.append(req)
            if kept:
                events.append(StepEvent(req, kept, False))
        if not self.running:
            return events
        # 2. pages for what this step may write (its shape's span); preempt the newest when
        # short, and ask again: a smaller batch may take another shape
        batch = self.running
        try:
            while self.running:
                shape = next_shape(self.runner, self.running)
                if self._reserve(shape.max_emit):
                    break
            if not self.running:
                return events
            # 3. the step
            batch = list(self.running)
            emitted, accepted = run_step(self.runner, batch, shape.drafts)
            results: list[tuple[list[int], int, list[Logprob] | None] | BaseException] = [
                *zip(emitted, accepted, self._logprobs(batch))]
        except Exception as e:  # noqa: BLE001 - isolated below, or raised again
            batch = list(self.running)
            results = self._one_by_one(batch, e, self._step_alone)
        # 4. apply
        blamed = any(isinstance(x, tuple) for x in results)
        still = []
        for req, res in zip(batch, results):
            if res is None:  # preempted while running alone
                continue
            if isinstance(res, BaseException):
                events.append(self._failed(req, res, blamed))
                continue
            toks, acc, lps = res
            req.num_steps += 1
            req.accept_lengths.append(acc + 1)
            kept = self._applied(req, toks, lps, events)
            if kept is None:
                continue
            events.append(StepEvent(req, kept, req.finished, acc + 1))
            if req.finished:
                self._release(req)
            else:
                still.append(req)
        self.running = still
        return events

    # ---- fault isolation -------------------------------------------------------------------------

    def _one_by_one(self, reqs: list[Request], err: Exception, call: Callable[[Request], Any]
                    ) -> list[Any]:
        """After a model call over `reqs` raised `err`: `call` for each request alone, its result
        or its exception. Without `isolate`, or for a `fatal` error, `err` rises again.
        NOTE: a failed call commits nothing (cache lengths advance only after a call returns),
        and whatever it wrote past a row's cache length is garbage the next call overwrites,
        as after any step's rejected drafts: running a row again is safe."""
        if not self.isolate or isinstance(err, self.fatal):
            raise err
        if len(reqs) == 1:
            return [err]
        out: list[Any] = []
        for req in reqs:
            try:
                out.append(call(req))
            except Exception as e:  # noqa: BLE001 - this row's failure
                if isinstance(e, self.fatal):
                    raise
                out.append(e)
        return out

    def _step_alone(self, req: Request) -> tuple[list[int], int, list[Logprob] | None] | None:
        """One step of `req` on its own: its tokens, accepted drafts and log-probabilities, or
        None when the pool has no pages for its shape's span (it goes back to the queue,
        preempted)."""
        shape = next_shape(self.runner, [req])
        try:
            self._grow(req, req.cache_len + shape.max_emit)
        except OutOfPages:
            self._preempt(req)
            return None
        emitted, accepted = run_step(self.runner, [req], shape.drafts)
        return emitted[0], accepted[0], self._logprobs([req])[0]

    def _applied(self, req: Request, toks: list[int], logprobs: Sequence[Logprob] | None,
                 events: list[StepEvent]) -> list[int] | None:
        """`_apply(req, toks, logprobs)`; with `isolate`, a host-side failure there (a token
        its grammar refuses included) is `req`'s own: it fails alone (an event in `events`)
        and None is returned."""
        try:
            return self._apply(req, toks, logprobs)
        except Exception as e:  # noqa: BLE001 - raised again unless isolated
            if not self.isolate:
                raise
            events.append(self._failed(req, e, True))
            return None

    def _failed(self, req: Request, err: BaseException, blamed: bool) -> StepEvent:
        """`req` ends with reason "error" (its pages freed), failed by `err`."""
        self._drop(req)
        self._release(req, keep=False)
        req.finish_reason = "error"
        return StepEvent(req, [], True, error=err, blamed=blamed)
