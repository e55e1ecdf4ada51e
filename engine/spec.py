"""The speculative step: draft -> build -> verify -> decide -> commit, as one function over static
buffers. Every shape is fixed by `(bs, N)` and the page-table width, nothing reads a tensor value
on the host, so the same function runs eagerly on a CPU and inside one CUDA graph per batch size.

Between the verify and the decide a step may adjust the target's logits (each row's bias, a
grammar's mask at the root: `adjust_logits`), and after the decide report the emitted tokens'
log-probabilities (`write_logprobs`), in the step variants whose rows ask (`StepShape.adjust`,
`StepShape.logprobs`).

Positions: a request's target cache holds `cache_len` committed tokens; the anchor (the last
emitted token, not yet in the cache) sits at position `cache_len`, and a tree node of depth `d`
at `cache_len + d`. The commit writes the root and the accepted nodes at `cache_len ..
cache_len + accept_len`, and the bonus token becomes the next anchor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from engine.attention import AttentionBackend, TorchBackend
from engine.config import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, MODES
from engine.dist import Group
from engine.kv_cache import DUMMY_PAGE, KVPool
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from engine.models.vision import KimiVision
from ops.logits import add_bias_, emitted_logprobs, mask_, token_logprobs
from ops.prefill import TORCH_MHA, MHAPass
from ops.sampling import argmax, race_logits, sample_from_probs, target_probs
from ops.tree import DDTree, build_ddtree, build_ddtree_host, chain_tree
from ops.verify import Decision, tree_greedy, tree_greedy_host


@dataclass(frozen=True)
class StepShape:
    """The static knobs of one captured step: every tensor shape follows from these."""

    mode: str  # "tree", "chain" or "ar"
    budget: int  # tree nodes besides the root (tree mode; 0: plain decoding, drafter fed)
    block_size: int  # drafter block (anchor + L drafts); unused in ar mode
    sample: bool  # tree sampling (True) or the greedy walk (False)
    # Some row may use top-k/top-p (sampling only). False skips the vocabulary sort; a captured
    # sampling graph keeps True (its greedy and padding rows are top-k 1).
    filtered: bool = True
    # Rows that truncate and rows that may need the full vocabulary sort (eager: counts from
    # `ops.sampling.row_path`; a captured or compiled graph: 0 or every row, its sampling
    # variant, `engine.runner.SAMPLING_VARIANTS`); None: every row, which serves any mix.
    topk_rows: int | None = None
    sort_rows: int | None = None
    # Eager only: the step may read the device on the host. It then builds the tree there
    # (`ops.tree.build_ddtree_host`), sorts the truncating rows only when the bounded cut is not
    # exact, and picks out the rows that sample (greedy ones take the argmax and never pay for
    # the race); a captured or compiled graph runs every row alike.
    host_reads: bool = False
    # Some row has a logit bias or a grammar (`adjust_logits`): the step adds the biases to
    # every node's logits, masks the root's to the grammar's tokens, and cuts the grammar rows'
    # trees to their root. Off, none of the adjustment buffers is read.
    adjust: bool = False
    # Some row wants log-probabilities: the step writes those of its emitted tokens and the
    # `MAX_TOP_LOGPROBS` most likely there (`lp_*` outputs). Off, it computes none.
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "tree" and self.budget < 0:
            raise ValueError(f"tree budget must be >= 0, got {self.budget}")

    @property
    def drafts(self) -> bool:
        """Whether the step runs the drafter and feeds its cache. A tree of budget 0 is plain
        decoding, costing what `ar` costs: a request's next drafting step (another batch size,
        another budget) first brings its drafter cache up to date (`catch_up`)."""
        return self.mode == "chain" or self.mode == "tree" and self.budget > 0

    @property
    def depth(self) -> int:
        """L: the deepest node a step can accept."""
        return 0 if self.mode == "ar" else self.block_size - 1

    @property
    def draft_depth(self) -> int:
        """Depths the drafter's distributions are needed for: a tree of `budget` nodes cannot
        reach deeper than `budget`."""
        return min(self.budget, self.depth) if self.mode == "tree" else self.depth

    @property
    def num_nodes(self) -> int:
        """N: tree nodes including the root."""
        return {"tree": self.budget + 1, "chain": self.depth + 1, "ar": 1}[self.mode]

    @property
    def max_emit(self) -> int:
        """S: tokens a step can emit (accepted drafts plus the bonus)."""
        return min(self.num_nodes, self.depth + 1)


# The value of each step input in a padding row. NOTE: padding rows have zero context and only
# the dummy page, so every kernel treats them as ordinary rows while their writes land on the
# dummy page; they sample greedily (temperature 1, top-k 1) and draw no coins.
PADDING = {"anchor": 0, "cache_len": 0, "page_table": DUMMY_PAGE, "temperature": 1.0,
           "top_k": 1, "top_p": 1.0, "coins": 0.0, "bias_ids": 0, "bias_values": 0.0,
           "allowed": -1, "plain": False}
# The inputs only a step that `adjust`s reads (the host stages them for such a step only).
ADJUST_INPUTS = ("bias_ids", "bias_values", "allowed", "plain")


@dataclass
class StepBuffers:
    """Per-step inputs and outputs, `[bs, ...]`, allocated once per captured batch size."""

    # inputs, copied in by the host before each step
    anchor: Tensor  # [bs] int64: last emitted token
    cache_len: Tensor  # [bs] int64: committed tokens in the cache
    page_table: Tensor  # [bs, W] int64: pages of the request, DUMMY_PAGE past its end
    temperature: Tensor  # [bs] f32 (greedy rows: 1)
    top_k: Tensor  # [bs] int64 (greedy rows: 1; off: 0)
    top_p: Tensor  # [bs] f32
    coins: Tensor  # [bs, S] f32 uniform, one per position a step may emit (depth 0 first)
    # logit adjustments (read when the shape `adjust`s): MAX_LOGIT_BIAS (token, bias) entries
    # (unused: token 0, bias 0), the grammar's allowed tokens at the root (every bit set: no
    # grammar), and whether the row decodes plainly, its tree cut to the root (a grammar row)
    bias_ids: Tensor  # [bs, MAX_LOGIT_BIAS] int64
    bias_values: Tensor  # [bs, MAX_LOGIT_BIAS] f32
    allowed: Tensor  # [bs, ceil(V / 32)] int32 token bitmask
    plain: Tensor  # [bs] bool
    # scratch: the verify forward's own latent rows, read by the commit
    tree_kv: Tensor  # [layers, bs, N, R + P]
    # outputs, read back by the host
    emit: Tensor  # [bs, S] int64, -1 padded
    accept_len: Tensor  # [bs] int64
    accept_nodes: Tensor  # [bs, S] int64, -1 padded
    # log-probabilities of the emitted tokens and of the most likely tokens at each (written
    # when the shape wants `logprobs`; `ops.logits.emitted_logprobs`)
    lp_token: Tensor  # [bs, S] f32
    lp_top: Tensor  # [bs, S, T] f32, T = min(MAX_TOP_LOGPROBS, V)
    lp_top_ids: Tensor  # [bs, S, T] int64

    @classmethod
    def allocate(cls, bs: int, width: int, shape: StepShape | Sequence[StepShape],
                 target: KimiForCausalLM, device: torch.device | str) -> StepBuffers:
        """Buffers wide enough for every shape in `shape` (see `fit`)."""
        c = target.cfg
        shapes = [shape] if isinstance(shape, StepShape) else list(shape)
        N, S = max(s.num_nodes for s in shapes), max(s.max_emit for s in shapes)
        T = min(MAX_TOP_LOGPROBS, c.vocab_size)
        z = dict(device=device)
        return cls(
            anchor=torch.zeros(bs, dtype=torch.int64, **z),
            cache_len=torch.zeros(bs, dtype=torch.int64, **z),
            page_table=torch.zeros(bs, width, dtype=torch.int64, **z),
            temperature=torch.ones(bs, **z),
            top_k=torch.ones(bs, dtype=torch.int64, **z),
            top_p=torch.ones(bs, **z),
            coins=torch.zeros(bs, S, **z),
            bias_ids=torch.zeros(bs, MAX_LOGIT_BIAS, dtype=torch.int64, **z),
            bias_values=torch.zeros(bs, MAX_LOGIT_BIAS, **z),
            allowed=torch.full((bs, -(-c.vocab_size // 32)), -1, dtype=torch.int32, **z),
            plain=torch.zeros(bs, dtype=torch.bool, **z),
            tree_kv=torch.zeros(c.num_hidden_layers, bs, N, c.kv_cache_dim,
                                dtype=target.lm_head.weight.dtype, **z),
            emit=torch.full((bs, S), -1, dtype=torch.int64, **z),
            accept_len=torch.zeros(bs, dtype=torch.int64, **z),
            accept_nodes=torch.full((bs, S), -1, dtype=torch.int64, **z),
            lp_token=torch.zeros(bs, S, **z),
            lp_top=torch.zeros(bs, S, T, **z),
            lp_top_ids=torch.zeros(bs, S, T, dtype=torch.int64, **z),
        )

    def rows(self, n: int) -> StepBuffers:
        """Views of the first `n` rows (a smaller batch over the same storage)."""
        return StepBuffers(**{f.name: (getattr(self, f.name)[:, :n] if f.name == "tree_kv"
                                       else getattr(self, f.name)[:n]) for f in fields(self)})

    def fit(self, shape: StepShape) -> StepBuffers:
        """Views as wide as `shape`'s nodes and emits (buffers serve every shape of a size)."""
        N, S = shape.num_nodes, shape.max_emit
        return replace(self, coins=self.coins[:, :S], tree_kv=self.tree_kv[:, :, :N],
                       emit=self.emit[:, :S], accept_nodes=self.accept_nodes[:, :S],
                       lp_token=self.lp_token[:, :S], lp_top=self.lp_top[:, :S],
                       lp_top_ids=self.lp_top_ids[:, :S])

    def inputs(self) -> dict[str, Tensor]:
        """The per-step inputs the host copies in, by field name."""
        return {k: getattr(self, k) for k in PADDING}


@dataclass
class Models:
    target: KimiForCausalLM
    drafter: DFlashDrafter | None = None
    # Tensor parallelism: this rank's group (`engine.dist`); None in a single process.
    tp: Group | None = None
    # How attention reads the paged caches (`engine.attention.select_backend`): the step
    # only calls its hooks.
    attention: AttentionBackend = field(default_factory=TorchBackend)
    # K2.5's vision tower and projector (whole on every rank), when the checkpoint has them.
    vision: KimiVision | None = None

    def kv_pool(self, page_size: int, num_pages: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> KVPool:
        """A paged pool for these models: the target's latent rows and the drafter's K/V."""
        c, d = self.target.cfg, self.drafter
        return KVPool.allocate(page_size=page_size, num_pages=num_pages,
                               target_layers=c.num_hidden_layers, target_dim=c.kv_cache_dim,
                               draft_layers=d.c.num_hidden_layers if d else 0,
                               draft_dim=d.kv_dim if d else 0, dtype=dtype, device=device)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token takes in `kv_pool` (this rank's, every layer)."""
        c, d = self.target.cfg, self.drafter
        width = c.num_hidden_layers * c.kv_cache_dim + (
            d.c.num_hidden_layers * d.kv_dim if d else 0)
        return width * (torch.finfo(dtype).bits // 8)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.drafter.c.target_layer_ids if self.drafter is not None else ()


Timer = Callable[[str], contextlib.AbstractContextManager]
# How the target's expert banks run a forward of `n` tokens (`ExpertBank.forward`'s mode): the
# runner chooses one per execution path (`StepGraphRunner.expert_pass`); the model runs it.
ExpertPass = Callable[[int], str]


def _no_timer(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def sparse_pass(n: int) -> str:
    """Each token through its chosen experts only: eager forwards' pass unless told otherwise
    (data-dependent shapes, so never in a graph)."""
    return "sparse"


def aligned_pass(n: int) -> str:
    """The chosen experts over aligned blocks, at fixed shapes: a captured step's pass, and
    off the CPU every forward's (the grouped expert GEMMs)."""
    return "aligned"


def slot_of(page_table: Tensor, pos: Tensor, page_size: int) -> Tensor:
    """Flat cache slot of position `pos [bs, M]` through `page_table [bs, W]`. Positions past
    the table resolve into the dummy page (their writes are discarded by construction)."""
    page = (pos // page_size).clamp(max=page_table.shape[1] - 1)
    return page_table.gather(1, page) * page_size + pos % page_size


def draft(models: Models, pool: KVPool, buf: StepBuffers, shape: StepShape,
          ctx_slots: Tensor | None) -> Tensor:
    """Draft logits `[bs, D, V]` (`D = shape.draft_depth`) for the block `[anchor, MASK x L]`
    at `cache_len ..`; the context as the attention backend hands it over (`ctx_slots`: the
    step's gathered slots `[bs, C]`, or None where its kernels read the pages in place)."""
    target, drafter = models.target, models.drafter
    bs, B = buf.anchor.shape[0], shape.block_size
    block = torch.full((bs, B), drafter.c.mask_token_id, dtype=torch.int64,
                       device=buf.anchor.device)
    block[:, 0] = buf.anchor
    positions = buf.cache_len[:, None] + torch.arange(B, device=block.device)
    ctx_kv, ctx_valid = models.attention.draft_context(pool.draft, buf.page_table, buf.cache_len,
                                                       pool.page_size, ctx_slots)
    # NOTE: row 0 (the anchor's own) predicts nothing; row j predicts depth j. The block stays
    # whole even when the tree reads fewer depths: its rows see each other, and the drafter was
    # trained on whole blocks. Cut to the depths a tree reads, the bundled drafter accepted
    # fewer tokens a step, and its eager pass took no less time.
    D = shape.draft_depth
    h = drafter(target.model.embed_tokens(block), positions, ctx_kv, ctx_valid, rows=(1, D + 1))
    return target.lm_head(h).float()


def couple(draft_logits: Tensor, buf: StepBuffers, rows: Tensor | None) -> Tensor:
    """Sampled rows' draft logits as the target's draws would rank them: the drafter's logits
    at depth `d + 1` over the row's temperature, raced with the coin of the position that depth
    fills (`race_logits`). The tree's spine is then what the drafter itself would draw with the
    step's coins, which the target draws too wherever the two distributions agree. Untruncated:
    the drafter cannot know where the target's top-k or nucleus ends, and cut as the target is
    cut it accepted less with the bundled pair. Every token races: racing only the drafter's
    most likely few lost accepted tokens with the bundled pair (a tail token wins the
    target's race often enough). Greedy rows keep their logits; `rows`: the
    sampling rows (`sampled_rows`), or None to race every row alike (a graph)."""
    coins = buf.coins[:, :draft_logits.shape[1]]
    if rows is None:
        raced = race_logits(draft_logits / buf.temperature[:, None, None], coins)
        return torch.where((buf.top_k != 1)[:, None, None], raced, draft_logits)
    if not len(rows):
        return draft_logits
    raced = race_logits(draft_logits[rows] / buf.temperature[rows, None, None], coins[rows])
    return draft_logits.index_copy(0, rows, raced)


def sampled_rows(buf: StepBuffers, shape: StepShape) -> Tensor | None:
    """The ids of the rows that sample (greedy rows are top-k 1), read on the host when the
    step samples and may read (`shape.host_reads`); None otherwise (a graph: every row alike).
    A step finds them once, for both `build` and `decide`."""
    return (buf.top_k != 1).nonzero()[:, 0] if shape.sample and shape.host_reads else None


def _row_probs(logits: Tensor, buf: StepBuffers, shape: StepShape, rows: Tensor | None = None
               ) -> Tensor:
    """`target_probs` of `logits [bs, ..., V]` with each row's sampling parameters, for `rows`
    only when given."""
    t, k, p = buf.temperature, buf.top_k, buf.top_p
    if rows is not None:
        logits, t, k, p = logits[rows], t[rows], k[rows], p[rows]
    return target_probs(logits, t, k, p, shape.filtered, topk_rows=shape.topk_rows,
                        sort_rows=shape.sort_rows, sort_if_needed=shape.host_reads)


def build(draft_logits: Tensor | None, buf: StepBuffers, shape: StepShape,
          rows: Tensor | None = None) -> DDTree:
    """The step's tree; `rows`: as in `couple`."""
    if shape.drafts:
        assert draft_logits is not None
        if shape.sample:
            draft_logits = couple(draft_logits[:, :shape.draft_depth], buf, rows)
        if shape.mode == "tree":
            fn = build_ddtree_host if shape.host_reads else build_ddtree
            return fn(draft_logits, shape.budget, buf.anchor)
        return chain_tree(draft_logits, buf.anchor)
    # ar or budget 0: the tree is the root alone; the decide then emits only the bonus token
    bs = buf.anchor.shape[0]
    z = torch.zeros(bs, 1, dtype=torch.int64, device=buf.anchor.device)
    return DDTree(tokens=buf.anchor[:, None].clone(), parent=z - 1, depth=z,
                  logw=z.float(), valid=torch.ones_like(z, dtype=torch.bool),
                  next_token=z - 1, next_sibling=z - 1,
                  visible=torch.ones(bs, 1, 1, dtype=torch.bool, device=z.device))


def cut_to_root(tree: DDTree, plain: Tensor) -> DDTree:
    """`tree` with the children of the `plain [bs]` rows' roots cut off: those rows accept
    nothing and emit only the root's token, as plain decoding does (a grammar's mask holds at
    the root only). Their other nodes are still verified, and never read."""
    first = torch.where(plain, -1, tree.next_token[:, 0])
    return replace(tree, next_token=torch.cat([first[:, None], tree.next_token[:, 1:]], 1))


def adjust_logits(logits: Tensor, buf: StepBuffers) -> None:
    """Each row's logit bias on every node of `logits [bs, N, V]`, and its grammar's mask on
    the root's, in place (a row without them: bias entries of 0, every token allowed)."""
    add_bias_(logits, buf.bias_ids, buf.bias_values)
    mask_(logits[:, 0], buf.allowed)


def write_logprobs(logits: Tensor, dec: Decision, buf: StepBuffers, shape: StepShape) -> None:
    """The log-probabilities of the emitted tokens (token `j` drawn at accepted node `j`) and
    of the most likely tokens there, from `logits` as the decide read them, less the bias: the
    unbiased log-softmax, with a grammar's mask (`ops.logits.emitted_logprobs`)."""
    bias = (buf.bias_ids, buf.bias_values) if shape.adjust else (None, None)
    token, top, ids = emitted_logprobs(logits, dec.accept_nodes, dec.emit,
                                       buf.lp_top.shape[-1], *bias)
    buf.lp_token.copy_(token)
    buf.lp_top.copy_(top)
    buf.lp_top_ids.copy_(ids)


def broadcast_decision(tp: Group, dec: Decision) -> Decision:
    """Rank 0's decision on every rank (one fixed-size broadcast, graph-safe)."""
    S = dec.emit.shape[1]
    packed = torch.cat([dec.accept_len[:, None], dec.accept_nodes, dec.emit], dim=1)
    packed = tp.broadcast_(packed.contiguous(), src=0)
    return Decision(accept_nodes=packed[:, 1:1 + S], accept_len=packed[:, 0],
                    emit=packed[:, 1 + S:])


def decide(logits: Tensor, tree: DDTree, buf: StepBuffers, shape: StepShape,
           rows: Tensor | None = None) -> Decision:
    """The accepted nodes and emitted tokens; `rows`: as in `couple`."""
    L = shape.depth
    walk = tree_greedy_host if shape.host_reads else tree_greedy
    if not shape.sample:
        return walk(tree.tokens, tree.next_token, tree.next_sibling, argmax(logits), max_accept=L)
    # A node at depth d draws the token of the step's d-th position, with that position's coin
    # (depths run 0 .. S - 1: a tree of budget K reaches depth min(K, L), and S = min(K, L) + 1).
    # The walk is then the greedy one over the draws (`ops.verify.tree_sample`).
    coins = buf.coins.gather(1, tree.depth)
    if rows is None:
        drawn = sample_from_probs(_row_probs(logits, buf, shape), coins)
    else:  # greedy rows take the argmax, as in a greedy step; only the sampling rows race
        drawn = argmax(logits)
        if len(rows):
            drawn = drawn.index_copy(0, rows, sample_from_probs(
                _row_probs(logits, buf, shape, rows), coins[rows]))
    return walk(tree.tokens, tree.next_token, tree.next_sibling, drawn, max_accept=L)


def feed_drafter(drafter: DFlashDrafter, pool: KVPool, feats: Tensor, positions: Tensor,
                 slots: Tensor) -> None:
    """Write the drafter's context rows of committed tokens into its cache: target features
    `feats [..., n * H]` at `positions [...]`, to the flat cache `slots` (one per position)."""
    kv = drafter.context_kv(feats, positions)  # [draft_layers, ..., kv_dim]
    pool.draft[:, slots] = kv.reshape(kv.shape[0], -1, kv.shape[-1]).to(pool.draft.dtype)


def commit(models: Models, pool: KVPool, buf: StepBuffers, dec: Decision, aux: Tensor | None,
           shape: StepShape) -> None:
    """Move the root and accepted nodes' latent rows to `cache_len ..`, hand their target
    features (`aux`, from a drafting step) to the drafter's cache, and publish the decision."""
    bs, S = dec.accept_nodes.shape
    j = torch.arange(S, device=buf.anchor.device)
    keep = j[None, :] <= dec.accept_len[:, None]  # [bs, S]
    node = dec.accept_nodes.clamp(min=0)
    pos = buf.cache_len[:, None] + j
    # NOTE: entries past accept_len go to slot 0 of the dummy page, never to a real page.
    dest = torch.where(keep, slot_of(buf.page_table, pos, pool.page_size), 0).reshape(-1)
    rows = buf.tree_kv[:, torch.arange(bs, device=node.device)[:, None], node]
    pool.target[:, dest] = rows.reshape(rows.shape[0], bs * S, -1)
    if aux is not None and models.drafter is not None:
        feats = aux.gather(1, node[..., None].expand(-1, -1, aux.shape[-1]))  # [bs, S, nH]
        feed_drafter(models.drafter, pool, feats, pos, dest)
    buf.emit.copy_(dec.emit)
    buf.accept_len.copy_(dec.accept_len)
    buf.accept_nodes.copy_(dec.accept_nodes)


def prefill_forward(target: KimiForCausalLM, ids: Tensor, last: Tensor, aux_layers: Sequence[int],
                    moe: str, drafter: DFlashDrafter | None = None,
                    embeds: tuple[Tensor, Tensor] | None = None, *,
                    attention: MHAPass = TORCH_MHA) -> tuple[Tensor, Tensor | None, Tensor]:
    """The prefill's forward over `ids [B, T]` (at positions `0 ..`) with the expert pass `moe`
    and the attention backend's MHA pass `attention`: the logits at `last [B, 1]` (`[B, V]`),
    the drafter's context rows of every position `[draft_layers, B, T, kv_dim]` (None without
    a drafter) and every layer's cache rows `[layers, B, T, R + P]`. `embeds`: rows replacing
    token embeddings (`KimiForCausalLM.embed`)."""
    rows: list[Tensor] = []
    logits, aux = target(ids, aux_layers, moe=moe, logits_rows=last, cache_rows_out=rows,
                         attention=attention, embeds=embeds)
    assert logits is not None
    # NOTE: the drafter's context rows are made here, so a compiled prefill makes them in its
    # graph too (eagerly, after the graph, they were 66 small ops of their own).
    ctx = None
    if drafter is not None and aux is not None:
        pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        ctx = drafter.context_kv(aux, pos)
    return logits[:, 0], ctx, torch.stack(rows)


@dataclass
class Embeds:
    """Rows that replace token embeddings in a prefill: `rows [K, H]` at `offsets` (K of them,
    within the sequence or chunk): an image's projected features at its placeholder tokens."""

    offsets: list[int]
    rows: Tensor


def staged(data: Any, dev: torch.device) -> Tensor:
    """A host list (ids, positions, pages) as a tensor on `dev` without making the host wait:
    on CUDA through pinned memory, copied asynchronously (a copy from pageable memory waits
    for the stream's work so far); elsewhere as is."""
    t = torch.tensor(data, pin_memory=dev.type == "cuda")
    return t.to(dev, non_blocking=True)


def _flat_embeds(embeds: Sequence[Embeds | None] | None, T: int, dev: torch.device
                 ) -> tuple[Tensor, Tensor] | None:
    """`embeds` of `B` sequences padded to `T` tokens as `KimiForCausalLM.embed` takes them:
    flat indices into the `B * T` tokens and their rows."""
    parts = [(b, e) for b, e in enumerate(embeds or ()) if e is not None and e.offsets]
    if not parts:
        return None
    where = staged([b * T + o for b, e in parts for o in e.offsets], dev)
    return where, torch.cat([e.rows for _, e in parts]).to(dev)


@torch.no_grad()
def prefill(models: Models, pool: KVPool, ctxs: Sequence[Sequence[int]],
            pages: Sequence[Sequence[int]], forward: Callable[..., Any] | None = None,
            expert_pass: ExpertPass = sparse_pass,
            embeds: Sequence[Embeds | None] | None = None) -> Tensor:
    """One causal forward over the sequences `ctxs` (each at positions `0 ..`, right-padded to
    the longest: a causal token never sees the padding after it) writing each one's target
    latent rows and drafter context K/V into its `pages`; returns each one's last-position
    logits `[B, V]`. `forward`: `prefill_forward` or a compiled one (its length symbolic, and at
    least 2, since a length of 1 would specialize into a graph of its own); `expert_pass` gives
    its expert pass for the `B x T` tokens (a fixed-shape one for a compiled forward).
    `embeds`: for each sequence, None or the rows replacing some of its token embeddings (an
    image's features at its placeholders: `Embeds`)."""
    lens = [len(c) for c in ctxs]
    if not lens or min(lens) == 0 or len(pages) != len(lens):
        raise ValueError(f"prefill needs one non-empty sequence per page list, got lengths "
                         f"{lens} and {len(pages)} page lists")
    B, T = len(lens), max(*lens, 1 if forward is None else 2)
    dev = pool.target.device
    ids = staged([list(c) + [0] * (T - len(c)) for c in ctxs], dev)
    last = staged(lens, dev)[:, None] - 1
    moe = expert_pass(B * T)
    flat = _flat_embeds(embeds, T, dev)
    if forward is None:
        logits, ctx, rows = prefill_forward(models.target, ids, last, models.aux_layers, moe,
                                            models.drafter, flat,
                                            attention=models.attention.prefill_pass())
    else:
        import torch._dynamo as dynamo

        dynamo.mark_dynamic(ids, 1)
        logits, ctx, rows = forward(models.target, ids, last, models.aux_layers, moe,
                                    models.drafter, flat,
                                    attention=models.attention.prefill_pass())
    pos = torch.arange(T, device=dev).expand(B, T)
    # NOTE: the real (unpadded) positions, flat, indexed from the lengths on the host: a
    # boolean mask would make the host wait for the device to count its true elements.
    real = staged([b * T + t for b, n in enumerate(lens) for t in range(n)], dev)
    width = max(map(len, pages))
    pt = staged([list(p) + [DUMMY_PAGE] * (width - len(p)) for p in pages], dev)
    slots = slot_of(pt, pos, pool.page_size).reshape(-1)[real]
    pool.target[:, slots] = rows.flatten(1, 2)[:, real].to(pool.target.dtype)
    if ctx is not None:
        pool.draft[:, slots] = ctx.flatten(1, 2)[:, real].to(pool.draft.dtype)
    return logits


@torch.inference_mode()
def prefill_chunk(models: Models, pool: KVPool, tokens: Sequence[int], start: int,
                  pages: Sequence[int], expert_pass: ExpertPass = sparse_pass,
                  write_target: bool = True, feed: bool = True, logits: str | None = "last",
                  embeds: Embeds | None = None) -> Tensor | None:
    """One forward of one request's `tokens` at positions `start ..`, its first `start`
    positions already cached in `pages`: the MHA form, causal within the tokens and over the
    cached prefix, whose latent rows each layer up-projects a bounded chunk at a time
    (`ops.prefill.mla_prefill`, through the attention backend's MHA pass), so nothing is
    `T x T` in the prompt and the activations follow the chunk, not the context. Writes the
    tokens' target latent rows with `write_target`, and their drafter context rows with `feed`
    (when there is a drafter). Returns their logits (fp32): `logits` "last" the last token's
    `[V]`, "all" every one's `[n, V]`, None none (and the forward stops after the last aux
    layer when only the drafter's rows are wanted). `expert_pass` gives the expert pass of its
    tokens. `embeds`: rows replacing some of the tokens' embeddings (`Embeds`, offsets within
    `tokens`). Eager: its lengths follow the request."""
    target, drafter = models.target, models.drafter
    dev, n = pool.target.device, len(tokens)
    if n == 0 or start < 0:
        raise ValueError(f"a chunk needs tokens at a position >= 0, got {n} at {start}")
    live = -(-(start + n) // pool.page_size)
    if live > len(pages):
        raise ValueError(f"positions up to {start + n} need {live} pages, got {len(pages)}")
    table = staged(list(pages[:live]), dev)[None]
    ids = staged(list(tokens), dev)[None]
    pos = start + torch.arange(n, device=dev)[None]
    rows: list[Tensor] = []
    aux_layers = models.aux_layers if feed and drafter is not None else ()
    out, aux = target(
        ids, aux_layers, expert_pass(n), cache_rows_out=rows,
        attention=models.attention.prefill_pass(), kv_cache=pool.target,
        prefix_slots=slot_of(table, torch.arange(start, device=dev)[None], pool.page_size),
        logits=logits or ("none" if write_target or not aux_layers else "features"),
        embeds=_flat_embeds([embeds], n, dev))
    slots = slot_of(table, pos, pool.page_size)[0]
    if write_target:
        pool.target[:, slots] = torch.stack(rows)[:, 0].to(pool.target.dtype)
    if aux is not None and drafter is not None:
        feed_drafter(drafter, pool, aux[0], pos[0], slots)
    return None if out is None else out[0, -1] if logits == "last" else out[0]


@torch.inference_mode()
def catch_up(models: Models, pool: KVPool, tokens: Sequence[int], start: int, pages: list[int],
             chunk: int = 256, expert_pass: ExpertPass = sparse_pass) -> None:
    """Write the drafter's context rows of committed `tokens` at positions `start ..`, which
    plain-decoding steps committed without feeding it: the target's features of those tokens
    come from `prefill_chunk` over its cached prefix, `chunk` tokens at a time. Only the
    drafter's cache is written, so the target's cache and every token stay as they were."""
    for a in range(0, len(tokens), chunk):
        prefill_chunk(models, pool, tokens[a:a + chunk], start + a, pages, expert_pass,
                      write_target=False, logits=None)


@torch.inference_mode()
def prompt_logprobs(models: Models, pool: KVPool, tokens: Sequence[int], pages: Sequence[int],
                    top: int, expert_pass: ExpertPass = sparse_pass, chunk: int = 64
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """The log-probabilities of `tokens[1:]`, each given the ones before it, over a context
    whose cache rows `pages` already hold: the token's `[T - 1]`, the `top` most likely
    tokens' `[T - 1, top]` and their ids. The forward runs again over the cached prefix,
    `chunk` tokens at a time (`prefill_chunk`, writing nothing), so its logits are
    `[chunk, V]` at most."""
    dev, n = pool.target.device, len(tokens)
    token_lp, top_lp, top_ids = [], [], []
    for a in range(0, n - 1, chunk):
        piece = list(tokens[a:min(a + chunk, n - 1)])
        m = len(piece)
        x = prefill_chunk(models, pool, piece, a, pages, expert_pass, write_target=False,
                          feed=False, logits="all")
        assert x is not None  # [m, V]: position a + i predicts tokens[a + i + 1]
        lp, vals, ids = token_logprobs(x, staged(list(tokens[a + 1:a + m + 1]), dev), top)
        token_lp.append(lp)
        top_lp.append(vals)
        top_ids.append(ids)
    if not token_lp:  # a one-token context: nothing to score
        z = torch.zeros(0, top, device=dev)
        return z.sum(1), z, z.long()
    return torch.cat(token_lp), torch.cat(top_lp), torch.cat(top_ids)


@torch.inference_mode()
def spec_step(models: Models, pool: KVPool, buf: StepBuffers, shape: StepShape,
              timer: Timer = _no_timer, moe: str = "aligned") -> None:
    """One speculative step for every row of `buf` (padding rows included); its verify runs
    the expert pass `moe` (by default the fixed-shape one a graph needs)."""
    ctx_slots = models.attention.slots(buf.page_table, pool.page_size)
    draft_logits = None
    rows = sampled_rows(buf, shape)
    if shape.drafts:
        with timer("draft"):
            draft_logits = draft(models, pool, buf, shape, ctx_slots)
    with timer("build"):
        tree = build(draft_logits, buf, shape, rows)
        if shape.adjust:
            tree = cut_to_root(tree, buf.plain)
    with timer("verify"):
        aux_layers = models.aux_layers if shape.drafts else ()
        logits, aux = models.target.verify(
            tree.tokens, tree.positions(buf.cache_len), pool.target, ctx_slots,
            buf.cache_len, tree.visible, buf.tree_kv, aux_layers, moe,
            models.attention.prefix(buf.page_table, shape.num_nodes, pool.page_size,
                                    models.target.cfg.softmax_scale))
    with timer("decide"):
        if shape.adjust:
            adjust_logits(logits, buf)
        dec = decide(logits, tree, buf, shape, rows)
        if models.tp is not None:
            # NOTE: every rank decides from the same gathered logits and coins, but only rank
            # 0's decision is committed anywhere, so rounding can never split the ranks' caches.
            dec = broadcast_decision(models.tp, dec)
    if shape.logprobs:
        with timer("logprobs"):
            write_logprobs(logits, dec, buf, shape)
    with timer("commit"):
        commit(models, pool, buf, dec, aux, shape)
