"""The spec step end to end: lossless greedy, exact sampling, the commit, batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

import engine.spec as spec
from engine import LLM, SamplingParams
from ops.paged import table_slots
from tests.spec_helpers import TARGETS, make_pair, sampling_oracle, use_oracle

PROMPT_LENS = [1, 200, 7, 64, 33, 120]
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)


def prompts_for(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 256, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module", params=sorted(TARGETS))
def pair(request, tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("spec"), request.param)


@pytest.fixture(scope="module")
def ar_reference(pair):
    target, _ = pair
    llm = LLM(target, mode="ar", max_batch_size=4, progress=False)
    return llm.generate(prompts_for(768), GREEDY)


def _tokens(outs):
    return [o.token_ids for o in outs]


def test_ar_equals_transformers(pair, ar_reference):
    from transformers import DeepseekV3ForCausalLM

    target, _ = pair
    hf = DeepseekV3ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for p, o in zip(prompts_for(768), ar_reference):
        seq = torch.tensor([p])
        with torch.no_grad():
            # NOTE: transformers' greedy decoding as its plain forward + argmax per step.
            # `generate()` itself routes through another attention path whose ~1e-6 drift
            # flipped a near-tied MoE routing on one 200-token prompt here (a 0.07 logit jump),
            # disagreeing with transformers' own forward; both forwards agree with ours to 3e-6.
            for _ in range(GREEDY.max_new_tokens):
                nxt = hf(seq).logits[0, -1].argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        assert o.token_ids == seq[0, len(p):].tolist()


@pytest.mark.parametrize("mode,budget", [("tree", 1), ("tree", 4), ("tree", 16), ("tree", 64),
                                         ("chain", 0)])
def test_greedy_lossless_random_drafter(pair, ar_reference, mode, budget):
    target, draft = pair
    llm = LLM(target, draft, mode=mode, budget=max(budget, 1), max_batch_size=4, progress=False)
    assert _tokens(llm.generate(prompts_for(768), GREEDY)) == _tokens(ar_reference)


@pytest.mark.parametrize("mode,budget", [("tree", 16), ("tree", 64), ("chain", 0)])
def test_greedy_lossless_agreeing_drafter(pair, ar_reference, mode, budget, monkeypatch):
    target, draft = pair
    oracle = use_oracle(monkeypatch, seed=budget)
    llm = LLM(target, draft, mode=mode, budget=max(budget, 1), max_batch_size=4, progress=False)
    outs = llm.generate(prompts_for(768), GREEDY)
    assert _tokens(outs) == _tokens(ar_reference)
    mean_acc = llm.stats["mean_accept_len"]
    print(f"\n{pair[0].name} {mode} budget {budget}: mean accepted length {mean_acc:.2f}")
    assert oracle.stats["calls"] > 0
    # deep paths were exercised, not only rejections
    assert max(a for o in outs for a in o.accept_lengths) >= 4
    assert mean_acc > (2.0 if mode == "tree" else 1.5)


def test_batch_invariance_and_padding(pair, monkeypatch):
    target, draft = pair
    use_oracle(monkeypatch, seed=7)
    ps = prompts_for(768, lens=[3, 50, 9, 17, 1, 80, 5, 26], seed=5)
    alone = []
    for p in ps:
        llm = LLM(target, draft, mode="tree", budget=8, max_batch_size=1, progress=False)
        alone.append(llm.generate([p], GREEDY)[0].token_ids)
    llm8 = LLM(target, draft, mode="tree", budget=8, max_batch_size=8, progress=False)
    assert _tokens(llm8.generate(ps, GREEDY)) == alone
    # three requests run padded to a captured size of 4 (rows 3.. are padding)
    llm4 = LLM(target, draft, mode="tree", budget=8, max_batch_size=4, progress=False)
    assert llm4.runner.padded_size(3) == 4
    assert _tokens(llm4.generate(ps[:3], GREEDY)) == alone[:3]


def test_commit_on_non_first_branch_matches_fresh_prefill(monkeypatch, tmp_path):
    """After a step whose accepted path leaves the first branch, the target's latent cache and
    the drafter's context cache equal a fresh prefill of the committed tokens."""
    target, draft = make_pair(tmp_path, "moe_groups_yarn")
    # the right depth-1 token is always second; deeper ones are on top
    use_oracle(monkeypatch, seed=11, demote=1.0, gap=9.0, demote_depths=1)
    llm = LLM(target, draft, mode="tree", budget=16, max_batch_size=1, progress=False)
    prompt = prompts_for(768, lens=[21], seed=9)[0]
    req = llm.make_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    sch = llm.scheduler
    sch.add(req)
    sch.step()  # admit + first spec step
    nodes = llm.runner.buffers[1].accept_nodes[0].tolist()
    acc = llm.runner.buffers[1].accept_len[0].item()
    assert acc >= 2, "the oracle's paths should be accepted"
    assert nodes[1] != 1, "the accepted depth-1 node must not be the first child"
    committed = req.prompt_ids + req.output_ids[:-1]
    assert req.cache_len == len(committed)
    # fresh prefill of the same tokens into a second engine
    llm2 = LLM(target, draft, mode="tree", budget=16, max_batch_size=1, progress=False)
    req2 = llm2.make_request(committed, SamplingParams(max_new_tokens=1, ignore_eos=True))
    llm2.scheduler.prefill([req2])
    ps = llm.pool.page_size

    def rows(pool, pages, n):
        slots = torch.tensor([pages[i // ps] * ps + i % ps for i in range(n)])
        return pool.target[:, slots], pool.draft[:, slots]

    t1, d1 = rows(llm.pool, req.pages, len(committed))
    t2, d2 = rows(llm2.pool, req2.pages, len(committed))
    assert (t1 - t2).abs().max().item() < 1e-4
    assert (d1 - d2).abs().max().item() < 1e-4



def test_a_batched_prefill_writes_what_each_prefill_alone_writes(pair):
    """One forward over prompts of different lengths (right-padded to the longest) fills each
    one's target and drafter caches, and gives its last logits, as its own prefill does: the
    padding never reaches a real row, and no write lands outside a prompt's pages."""
    from engine import spec

    target, draft = pair
    llm = LLM(target, draft, mode="tree", budget=4, max_batch_size=4, progress=False)
    pool, ps = llm.pool, llm.pool.page_size
    prompts = prompts_for(768, lens=[1, 200, 7, 33], seed=5)
    pages, first = [], 1
    for p in prompts:
        pages.append(list(range(first, first + -(-len(p) // ps))))
        first += len(pages[-1])
    pool.target.zero_()
    pool.draft.zero_()
    together = spec.prefill(llm.models, pool, prompts, pages)
    rows = pool.target.clone(), pool.draft.clone()
    pool.target.zero_()
    pool.draft.zero_()
    alone = torch.cat([spec.prefill(llm.models, pool, [p], [pg]) for p, pg in zip(prompts, pages)])
    assert together.shape == (4, 768)
    assert (together - alone).abs().max().item() < 1e-4
    assert together.argmax(-1).tolist() == alone.argmax(-1).tolist()
    for batched, single in zip(rows, (pool.target, pool.draft)):
        assert (batched - single).abs().max().item() < 1e-4
        assert batched[:, :ps].abs().max().item() == 0  # the dummy page stays untouched
    # each position's drafter rows are the drafter's context rows of the target's own features
    models = llm.models
    for p, pg in zip(prompts, pages):
        with torch.no_grad():
            _, aux = models.target(torch.tensor([p]), models.aux_layers)
            want = models.drafter.context_kv(aux[0], torch.arange(len(p)))
        got = pool.draft[:, table_slots(torch.tensor([pg]), ps)[0, :len(p)]]
        assert (got - want).abs().max().item() < 1e-4


def _exact_first3(target_dir, prompt, T, k, p):
    """Exact distribution of the first three sampled tokens by enumeration."""
    from engine.models.kimi import KimiForCausalLM
    from ops.sampling import target_probs

    m = KimiForCausalLM.from_dir(target_dir, progress=False)
    one = lambda x: torch.tensor([x])

    def q(prefix):
        logits, _ = m(torch.tensor([prompt + prefix]))
        return target_probs(logits[:, -1], one(T), one(k), one(p))[0]

    dist = {}
    q0 = q([])
    for a in q0.nonzero().flatten().tolist():
        q1 = q([a])
        for b in q1.nonzero().flatten().tolist():
            q2 = q([a, b])
            for c in q2.nonzero().flatten().tolist():
                dist[(a, b, c)] = (q0[a] * q1[b] * q2[c]).item()
    return dist


def _chi2_pvalue(counts, dist, n):
    exp, obs = [], []
    rest_e, rest_o = 0.0, 0
    for key, pr in dist.items():
        if pr * n >= 5:
            exp.append(pr * n)
            obs.append(counts.get(key, 0))
        else:
            rest_e += pr * n
            rest_o += counts.get(key, 0)
    outside = n - sum(counts.get(key, 0) for key in dist)
    assert outside == 0, f"{outside} samples outside the target's support"
    if rest_e > 0:
        exp.append(rest_e)
        obs.append(rest_o)
    total = sum(exp)  # equals n up to fp32 rounding of the enumerated probabilities
    return stats.chisquare(obs, [e * n / total for e in exp]).pvalue


@pytest.mark.parametrize("mode", ["tree", "ar"])
def test_sampling_first_three_tokens_exact(mode, monkeypatch, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "sampling"
    if not (root / "all_moe").exists():
        make_pair(root, "all_moe", vocab=520)
    target, draft = root / "all_moe", root / "all_moe-draft"
    T, k, p = 0.8, 5, 0.9
    prompt = [17, 4, 99, 3]
    dist = _exact_first3(target, prompt, T, k, p)
    if mode == "tree":
        use_oracle(monkeypatch, seed=3, demote=0.5)
    llm = LLM(target, draft if mode == "tree" else None, mode=mode, budget=8, max_batch_size=32,
              progress=False)
    n = 1200
    params = [SamplingParams(temperature=T, top_k=k, top_p=p, max_new_tokens=3, ignore_eos=True,
                             seed=1000 + i) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    pv = _chi2_pvalue(counts, dist, n)
    assert pv > 1e-4, f"{mode}: chi-square p = {pv:.2e}"
    assert math.isclose(sum(dist.values()), 1.0, rel_tol=1e-4)
    if mode == "tree":
        assert max(a for o in outs for a in o.accept_lengths) >= 2  # drafts were accepted


def test_vocabulary_is_sorted_only_for_rows_that_may_need_it(pair, monkeypatch):
    """Eager steps tell the sampler how many rows truncate and how many may need the full
    vocabulary sort; the counts change the work, never the tokens."""
    import engine.spec

    target, draft = pair
    seen: list[tuple[bool, int | None, int | None]] = []
    real = engine.spec.target_probs

    def spy(*a, **kw):
        seen.append((a[4], kw.get("topk_rows"), kw.get("sort_rows")))
        return real(*a, **kw)

    monkeypatch.setattr(engine.spec, "target_probs", spy)
    free = SamplingParams(temperature=0.9, max_new_tokens=16, ignore_eos=True, seed=5)
    ps = prompts_for(768, lens=[12, 5, 40], seed=3)
    llm = LLM(target, draft, mode="tree", budget=8, max_batch_size=4, progress=False)
    alone = llm.generate([ps[0]], free)[0].token_ids
    assert seen and set(seen) == {(False, 0, 0)}  # no top-k/top-p: the plain tempered softmax
    seen.clear()
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    mixed = llm.generate(ps[:2], [free, greedy])
    assert set(seen) == {(True, 0, 0)}  # a greedy row is top-k 1: an argmax, no sort
    assert mixed[0].token_ids == alone  # same distribution, same coins, same tokens
    assert mixed[1].token_ids == llm.generate([ps[1]], greedy)[0].token_ids
    seen.clear()
    top_k = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=8, ignore_eos=True, seed=1)
    top_p = SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=8, ignore_eos=True, seed=2)
    llm.generate(ps, [top_k, top_p, greedy])
    assert (True, 2, 1) in seen  # top-k 20 fits the bounded top-k; a nucleus may not


@pytest.mark.parametrize("mode,budget", [("tree", 0), ("tree", 4), ("tree", 16), ("chain", 0)])
def test_sampled_tokens_are_plain_decodings_with_the_same_seed(pair, mode, budget, monkeypatch):
    """A position's token is drawn with that position's coin in every mode, so a seeded
    sampling request emits what plain decoding emits, drafts accepted or not."""
    target, draft = pair
    ps = prompts_for(768, lens=[12, 5, 40, 1], seed=4)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=32, ignore_eos=True,
                             seed=s) for t, k, p, s in [(0.9, 20, 1.0, 11), (0.7, 0, 0.8, 12),
                                                        (1.0, 0, 1.0, 13)]]
    params.append(SamplingParams(max_new_tokens=32, ignore_eos=True))
    ar = LLM(target, mode="ar", max_batch_size=4, progress=False).generate(ps, params)
    use_oracle(monkeypatch, seed=budget)
    llm = LLM(target, draft, mode=mode, budget=budget, max_batch_size=4, progress=False)
    outs = llm.generate(ps, params)
    assert _tokens(outs) == _tokens(ar)
    if mode == "chain" or budget > 0:  # the sampled rows took drafts
        assert max(a for o in outs[:3] for a in o.accept_lengths) >= 2


@pytest.mark.parametrize("mode,budget", [("chain", None), ("tree", 16)])
def test_sampled_rows_draft_what_the_target_will_draw(pair, mode, budget, monkeypatch):
    """Coupled drafting: a sampled row's draft distributions are raced with the coins of the
    positions they fill. A drafter that knows the target's distributions then drafts what the
    target draws: its chain is accepted whole at every step; a tree holds that chain among its
    branches and accepts far more than without the coupling. The tokens stay plain decoding's
    (the third row truncates, which the drafter's race does not: it drafts less surely)."""
    target, draft = pair
    ps = prompts_for(768, lens=[12, 5, 40], seed=5)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=25, ignore_eos=True,
                             seed=s) for t, k, p, s in [(1.0, 0, 1.0, 1), (0.8, 0, 1.0, 2),
                                                        (1.2, 30, 0.9, 3)]]
    ar = LLM(target, mode="ar", max_batch_size=4, progress=False).generate(ps, params)
    monkeypatch.setattr(spec, "draft", sampling_oracle())
    llm = LLM(target, draft, mode=mode, budget=budget, max_batch_size=4, progress=False)
    outs = llm.generate(ps, params)
    assert _tokens(outs) == _tokens(ar)
    steps = sum(len(o.accept_lengths) for o in outs)
    if mode == "chain":  # 25 tokens: the prefill's, then three steps of 7 drafts and the bonus
        assert [o.accept_lengths for o in outs[:2]] == [[8, 8, 8]] * 2
    monkeypatch.setattr(spec, "couple", lambda logits, buf, rows: logits)
    uncoupled = llm.generate(ps, params)
    assert _tokens(uncoupled) == _tokens(ar)
    assert sum(len(o.accept_lengths) for o in uncoupled) > 1.5 * steps


def test_same_seed_same_output_whatever_the_batch(pair):
    target, draft = pair
    sp = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=24, ignore_eos=True, seed=42)
    ps = prompts_for(768, lens=[12, 5, 40], seed=2)
    llm = LLM(target, draft, mode="tree", budget=8, max_batch_size=4, progress=False)
    alone = llm.generate([ps[0]], sp)[0].token_ids
    mixed = llm.generate(ps, [sp, SamplingParams(temperature=1.0, seed=1, max_new_tokens=30),
                              SamplingParams(max_new_tokens=10)])[0].token_ids
    assert alone == mixed


