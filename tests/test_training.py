"""The training tools behind the bundled model: corpus split, drafter training."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys

import pytest
import torch

from engine.config import DraftConfig
from engine.llm import DEFAULT_DRAFT
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from tools import corpus
from tools.make_draft import draft_config
from tools.make_tiny import make_tiny
from tools.train_draft import train_drafter


def test_corpus_split_is_disjoint_and_stable():
    files = corpus.corpus_files()
    assert len(files) > 100 and files == sorted(files)
    held = {f for f in files if corpus.is_held_out(f)}
    assert 0 < len(held) < len(files) // 8
    assert not any(part in corpus.EXCLUDED_DIRS for f in files for part in f.split("/")[:-1])
    m = corpus.manifest()
    assert {f["path"] for f in m["files"] if f["split"] == "held_out"} == held
    prompts = corpus.held_out_prompts(5, seed=3)
    assert prompts == corpus.held_out_prompts(5, seed=3)
    held_text = "".join(t for _, t in corpus.read_split("held_out"))
    assert all(p in held_text and p.rstrip().endswith(":") for p in prompts)


def test_shipped_held_out_prompts_are_the_corpus_ones(monkeypatch):
    """The runtime's held-out prompts (`engine.held_out`: a file shipped with the bundled model,
    so the runtime never imports the training tools) are every prompt the tools cut from the
    corpus, in order, and sample the same for any seed."""
    from engine.held_out import HELD_OUT, held_out_prompts, read_candidates
    from engine.llm import DEFAULT_MODEL

    trained_on = json.loads((DEFAULT_MODEL / "training.json").read_text())["corpus"]["python"]
    if sys.version.split()[0] != trained_on:
        pytest.skip(f"the corpus is this Python's standard library; the bundled model's is "
                    f"Python {trained_on}'s")
    assert HELD_OUT.parent == DEFAULT_MODEL
    shipped = read_candidates()
    cut = corpus.held_out_candidates()
    assert len(shipped) > 100 and shipped == cut
    # NOTE: the draws below read the candidates just cut (cutting walks the whole library)
    monkeypatch.setattr(corpus, "held_out_candidates", lambda root=corpus.STDLIB: list(cut))
    for n, seed in [(1, 0), (3, 1), (3, 5), (16, 7)]:
        assert held_out_prompts(n, seed) == corpus.held_out_prompts(n, seed)
    with pytest.raises(ValueError, match="held-out prompts available"):
        held_out_prompts(len(shipped) + 1)


def test_drafter_learns_a_predictable_continuation(tmp_path):
    """On sequences whose continuation is a fixed cycle, the drafter's block loss must drop
    well below where it starts (it can learn from the anchor and the context features)."""
    make_tiny(tmp_path / "t", dtype="fp32")
    target = KimiForCausalLM.from_dir(tmp_path / "t", progress=False)
    conf = draft_config(tmp_path / "t", layers=1, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DraftConfig.from_dict(conf), target.cfg.hidden_size)
    cycle = torch.tensor([11, 22, 33, 44, 55])
    seqs = torch.stack([torch.cat([torch.randint(0, 700, (8,)), cycle.roll(-i).repeat(6)])
                        for i in range(10)])
    before = train_drafter(target, drafter, seqs, 8, steps=1, lr=1e-9, seed=0)
    after = train_drafter(target, drafter, seqs, 8, steps=80, lr=1e-2, seed=0)
    assert after < 0.3 * before, (before, after)
    assert not drafter.training and not any(p.requires_grad for p in drafter.parameters())


def test_draft_fit_scores_drafter_and_target_at_the_same_anchors(tmp_path, capsys):
    """`draft_fit` puts the drafter's first drafted token and the target's own next-token top 1
    side by side: on the target's greedy continuations the target is always right, and a drafter
    trained on a cycle drafts it right; its loss is the training loss at those anchors."""
    from tools.draft_fit import fit, main
    from tools.train_draft import target_sequences

    t = make_tiny(tmp_path / "t", dtype="fp32")
    target = KimiForCausalLM.from_dir(t, progress=False)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DraftConfig.from_dict(draft_config(t, layers=1, block_size=4)),
                            target.cfg.hidden_size)
    g = torch.Generator().manual_seed(0)
    greedy = torch.tensor(target_sequences(
        t, [torch.randint(0, 700, (6,), generator=g).tolist() for _ in range(8)], 10))
    assert fit(target, drafter, greedy, 6, anchors=4)["target_top1"] == 1.0
    cycle = torch.tensor([11, 22, 33, 44, 55])
    seqs = torch.stack([torch.cat([torch.randint(0, 700, (8,), generator=g),
                                   cycle.roll(-i).repeat(6)]) for i in range(10)])
    untrained = fit(target, drafter, seqs, 8, anchors=4)
    train_drafter(target, drafter, seqs, 8, steps=80, lr=1e-2, seed=0)
    trained = fit(target, drafter, seqs, 8, anchors=4)
    assert trained["top1"] == 1.0 > untrained["top1"]
    assert trained["loss"] < 0.3 * untrained["loss"]
    with pytest.raises(SystemExit, match="no training.json"):
        main(["--draft", str(tmp_path), "--target", str(t)])
    with pytest.raises(SystemExit):
        main(["--draft", str(DEFAULT_DRAFT), "--n", "2000"])
    assert "--n must be in 1..1536" in capsys.readouterr().err


def test_drafter_mlp_width_follows_the_config(tmp_path):
    """`--intermediate` sets each drafter layer's MLP width; by default it is twice the hidden."""
    make_tiny(tmp_path / "t", dtype="fp32")
    hidden = KimiForCausalLM.from_dir(tmp_path / "t", progress=False).cfg.hidden_size
    for width, want in ((None, 2 * hidden), (3 * hidden, 3 * hidden)):
        conf = draft_config(tmp_path / "t", layers=1, block_size=4, intermediate_size=width)
        mlp = DFlashDrafter(DraftConfig.from_dict(conf), hidden).layers[0].mlp
        assert conf["intermediate_size"] == want
        assert mlp.up_proj.weight.shape == (want, hidden)
        assert mlp.down_proj.weight.shape == (hidden, want)


def test_target_sequences_mix_greedy_and_seeded_samples(tmp_path):
    from engine import LLM, SamplingParams
    from tools.train_draft import target_sequences

    t = make_tiny(tmp_path / "t", dtype="fp32")
    prompts = [[5, 9, 300], [17, 4], [600, 3, 90, 2], [8]]
    seqs = target_sequences(t, prompts, 6, batch=4, sampled=0.5, temperature=1.0, seed=3)
    assert [s[:len(p)] for s, p in zip(seqs, prompts)] == prompts
    assert all(len(s) == len(p) + 6 for s, p in zip(seqs, prompts))
    llm = LLM(t, mode="ar", progress=False)
    greedy = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [s[len(p):] for s, p in zip(seqs[:2], prompts)] == [o.token_ids for o in greedy[:2]]
    assert seqs[2:] != [p + o.token_ids for p, o in zip(prompts[2:], greedy[2:])]  # sampled
    assert target_sequences(t, prompts, 6, batch=4, sampled=0.5, temperature=1.0,
                            seed=3) == seqs  # seeded: reproducible


def test_target_trains_through_the_sparse_expert_dispatch(tmp_path):
    """One training step's gradients through the sparse dispatch equal the dense path's."""
    from tools.train_target import init_weights

    make_tiny(tmp_path / "t", dtype="fp32", layers=2, experts=4)
    cfg = KimiForCausalLM.from_dir(tmp_path / "t", progress=False).cfg
    grads = []
    for sparse in (True, False):
        model = KimiForCausalLM(cfg)
        init_weights(model, seed=0)
        model.train()
        x = torch.randint(0, 700, (2, 12), generator=torch.Generator().manual_seed(1))
        logits, _ = model(x[:, :-1], moe="sparse" if sparse else "dense")
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert any(n.endswith("experts.w13") for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6)


def _options(args: list[str], drop: tuple[str, ...] = ("--target", "--out", "--init")
             ) -> dict[str, list[str]]:
    opts: dict[str, list[str]] = {}
    for a in args:
        if a.startswith("--"):
            key = a
            opts[key] = []
        else:
            opts[key].append(a)
    return {k: v for k, v in opts.items() if k not in drop}


def test_train_bundled_runs_the_shipped_pairs_recorded_recipe(tmp_path, capsys):
    """The one-command recipe is exactly what the shipped files record, stage for stage, each
    drafter stage starting from the one before."""
    from engine.llm import DEFAULT_DRAFT, DEFAULT_MODEL
    from tools.train_bundled import commands, main

    cmds = commands(tmp_path / "out", tmp_path / "work")
    assert [m for m, _ in cmds] == ["tools.train_target"] + ["tools.train_draft"] * 4
    assert all(importlib.util.find_spec(m) is not None for m, _ in cmds)
    recorded = [json.loads((DEFAULT_MODEL / "training.json").read_text())["command"]]
    stages = []
    rec = json.loads((DEFAULT_DRAFT / "training.json").read_text())
    while rec:
        stages.append(rec["command"])
        rec = rec["init_training"]
    recorded += stages[::-1]
    for (_, args), cmd in zip(cmds, recorded, strict=True):
        assert _options(args) == _options(shlex.split(cmd)[3:]), cmd
    drafts = [_options(args, drop=()) for _, args in cmds[1:]]
    assert all(d["--target"] == [str(tmp_path / "out" / "kimi-mini")] for d in drafts)
    assert "--init" not in drafts[0]
    assert all(b["--init"] == a["--out"] for a, b in zip(drafts, drafts[1:]))
    assert drafts[-1]["--out"] == [str(tmp_path / "out" / "kimi-mini-dflash")]
    main(["--out", str(tmp_path / "out"), "--dry-run"])
    assert len(capsys.readouterr().out.splitlines()) == 5 and not (tmp_path / "out").exists()
