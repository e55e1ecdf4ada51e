"""Shared fixtures for spec-engine tests: tiny checkpoints and an oracle drafter."""

from __future__ import annotations

from pathlib import Path

import torch

import engine.spec as spec
from ops.sampling import sample_from_probs, target_probs
from tools.make_draft import make_draft
from tools.make_tiny import make_tiny

TARGETS = {
    # MoE with expert groups and yarn; one dense layer first
    "moe_groups_yarn": dict(layers=3, experts=8, n_group=4, topk_group=2, experts_per_tok=2,
                            first_dense=1, yarn=True),
    # every layer MoE, plain rope
    "all_moe": dict(layers=2, experts=4, first_dense=0, yarn=False),
}


def make_pair(root: Path, name: str, vocab: int = 768, block_size: int = 8) -> tuple[Path, Path]:
    t, d = root / name, root / f"{name}-draft"
    make_tiny(t, dtype="fp32", vocab=vocab, seed=3, **TARGETS[name])
    make_draft(t, d, layers=1, block_size=block_size, seed=4)
    return t, d


def oracle_draft(seed: int = 0, demote: float = 0.35, noise: float = 1.0, gap: float = 3.0,
                 demote_depths: int | None = None):
    """A drafter that agrees with the target often: it computes the target's greedy chain from
    the anchor (with the target's own absorbed forward) and puts it on top of noisy logits, but
    demotes the right token to second place with probability `demote`, so accepted paths also
    run through non-first branches."""
    g = torch.Generator().manual_seed(seed)
    stats = {"calls": 0}

    def draft(models, pool, buf, shape, ctx_slots):
        bs, L = buf.anchor.shape[0], shape.depth
        chain, _ = target_chain(models, pool, buf, ctx_slots, L,
                                lambda logits, d: logits.argmax(-1))
        V = models.target.cfg.vocab_size
        out = torch.randn(bs, L, V, generator=g) * noise
        top = out.max(-1).values
        right = chain[:, 1:]
        flip = torch.rand(bs, L, generator=g) < demote
        if demote_depths is not None:
            flip[:, demote_depths:] = False
        val = torch.where(flip, top + gap - 1.0, top + gap)
        out.scatter_(2, right[..., None], val[..., None])
        wrong = (right + 1 + torch.randint(0, V - 1, (bs, L), generator=g)) % V
        out.scatter_(2, wrong[..., None], torch.where(flip, top + gap, top)[..., None])
        stats["calls"] += 1
        return out

    draft.stats = stats
    return draft


def sampling_oracle():
    """A drafter that knows the target's distributions: its depth-`d` logits are the target's
    own after the first `d` tokens that the step's coins draw (what plain decoding would emit),
    so a sampled row's coupled tree holds that continuation as its spine."""

    def draft(models, pool, buf, shape, ctx_slots):
        def draw(logits, d):
            probs = target_probs(logits[:, None], buf.temperature, buf.top_k, buf.top_p)
            return sample_from_probs(probs, buf.coins[:, d:d + 1])[:, 0]

        return target_chain(models, pool, buf, ctx_slots, shape.draft_depth, draw)[1]

    return draft


def target_chain(models, pool, buf, ctx_slots, L, pick):
    """The target's own continuation of each row's anchor for `L` tokens, token `d + 1` being
    `pick(logits at depth d [bs, V], d)`: the chain `[bs, L + 1]` and the logits `[bs, L, V]`."""
    target, c = models.target, models.target.cfg
    bs = buf.anchor.shape[0]
    chain = torch.zeros(bs, L + 1, dtype=torch.int64)
    chain[:, 0] = buf.anchor
    scratch = torch.zeros(c.num_hidden_layers, bs, L + 1, c.kv_cache_dim, dtype=buf.tree_kv.dtype)
    causal = torch.ones(L + 1, L + 1, dtype=torch.bool).tril()[None].expand(bs, -1, -1)
    pos = buf.cache_len[:, None] + torch.arange(L + 1)
    out = torch.zeros(bs, L, c.vocab_size)
    for d in range(L):
        logits, _ = target.verify(chain, pos, pool.target, ctx_slots, buf.cache_len, causal,
                                  scratch)
        out[:, d] = logits[:, d]
        chain[:, d + 1] = pick(logits[:, d], d)
    return chain, out


def use_oracle(monkeypatch, **kw):
    fn = oracle_draft(**kw)
    monkeypatch.setattr(spec, "draft", fn)
    return fn
