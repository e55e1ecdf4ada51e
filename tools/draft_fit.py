"""How well a drafter fits the target's continuations it learned from, against fresh ones.

    python -m tools.draft_fit --draft models/kimi-mini-dflash

Reads the last training stage's data recipe from the drafter's `training.json` (seed, windows,
sampled fraction and temperature), regenerates `--n` of that stage's greedy continuations and `--n`
of its sampled ones exactly as it made them (the engine's seeded sampling does not depend on the
batch), continues as many windows of the held-out files the same way, and prints for each set the
training loss (`train_draft.block_loss`, `--anchors` per sequence), how often the drafter's top 1
for the first drafted token is the continuation's token, and how often the target's own top 1 for
that token is (what a drafter that matched the target exactly would score). A drafter whose loss on
what it learned from sits well below its held-out loss has memorized that data, and more
continuations would teach it more; one at the same loss has learned all that kind of data gives it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.config import SamplingParams
from engine.llm import DEFAULT_MODEL, LLM
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from tools.train_draft import block_loss, corpus_prompts, window_seed


def continuations(llm: LLM, prompts: list[list[int]], idx: list[int], seed: int,
                  temperature: float | None, new_tokens: int) -> torch.Tensor:
    """`prompts[i]` + the target's continuation for `i` in `idx`, greedy (`temperature` None) or
    sampled with `train_draft.target_sequences`' seed for that window."""
    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True) if temperature is None
              else SamplingParams(temperature=temperature, max_new_tokens=new_tokens,
                                  ignore_eos=True, seed=window_seed(seed, i)) for i in idx]
    outs = llm.generate([prompts[i] for i in idx], params)
    return torch.tensor([list(prompts[i]) + o.token_ids for i, o in zip(idx, outs)])


@torch.no_grad()
def fit(target: KimiForCausalLM, drafter: DFlashDrafter, seqs: torch.Tensor, start: int,
        anchors: int, seed: int = 0) -> dict[str, float]:
    """Mean training loss over batches of 8 sequences, first-token top-1 of the drafter and of the
    target at the same anchors."""
    g = torch.Generator().manual_seed(seed)
    outs = [target(seqs[i:i + 16], drafter.c.target_layer_ids, moe="sparse")
            for i in range(0, len(seqs), 16)]
    logits, feats = (torch.cat(x) for x in zip(*outs))
    n, T = seqs.shape
    losses, hits, target_hits = [], [], []
    for i in range(0, n, 8):
        sel = torch.arange(i, min(i + 8, n))
        p = torch.randint(start, T - 1, (len(sel) * anchors,), generator=g)
        loss, hit = block_loss(target, drafter, seqs, feats, sel, p, anchors)
        rows = sel.repeat_interleave(anchors)
        losses.append(loss.item())
        hits.append(hit.float())
        # the target's logits at p (it has read s_p) predict s_{p+1}, the first drafted token
        target_hits.append((logits[rows, p].argmax(-1) == seqs[rows, p + 1]).float())
    return {"loss": sum(losses) / len(losses), "top1": torch.cat(hits).mean().item(),
            "target_top1": torch.cat(target_hits).mean().item()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.draft_fit",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument("--target", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--n", type=int, default=96, help="sequences per set")
    ap.add_argument("--anchors", type=int, default=8, help="anchor positions per sequence")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.anchors < 1:
        ap.error(f"--anchors must be at least 1, got {a.anchors}")
    record_path = a.draft / "training.json"
    if not record_path.is_file():
        raise SystemExit(f"--draft {a.draft}: no training.json to read its data recipe from")
    rec = json.loads(record_path.read_text())
    data, seed = rec["data"], rec["seed"]
    n_sampled = round(data["sampled"] * data["prompts"])
    n_greedy = data["prompts"] - n_sampled
    most = min(n_greedy, n_sampled) if n_sampled else n_greedy
    if not 1 <= a.n <= most:
        ap.error(f"--n must be in 1..{most}: the stage has {n_greedy} greedy and {n_sampled} "
                 f"sampled continuations, got {a.n}")
    if a.threads:
        torch.set_num_threads(a.threads)
    target = KimiForCausalLM.from_dir(a.target, progress=False)
    drafter = DFlashDrafter.from_dir(a.draft, target.cfg.hidden_size).float().eval()
    llm = LLM(a.target, mode="ar", max_batch_size=32, progress=False, compile="off")
    plen, new = data["prompt_len"], data["new_tokens"]
    learned = corpus_prompts(a.target, data["prompts"], plen, seed)
    fresh = corpus_prompts(a.target, a.n, plen, seed, split="held_out")
    temp = data["temperature"]
    sets = [("learned", "greedy", learned, list(range(a.n)), None),
            ("held-out", "greedy", fresh, list(range(a.n)), None)]
    if n_sampled:
        sets += [("learned", f"T={temp:g}", learned, list(range(n_greedy, n_greedy + a.n)), temp),
                 ("held-out", f"T={temp:g}", fresh, list(range(a.n)), temp)]
    print(f"{a.draft}: stage seed {seed}, {data['prompts']} windows ({n_sampled} sampled); "
          f"{a.n} sequences a set, {a.anchors} anchors each")
    print(f"{'windows':>9} {'kind':>7} {'loss':>6} {'top1':>5} {'target top1':>11}")
    for name, kind, prompts, idx, t in sets:
        r = fit(target, drafter, continuations(llm, prompts, idx, seed, t, new), plen, a.anchors)
        print(f"{name:>9} {kind:>7} {r['loss']:6.3f} {r['top1']:5.2f} {r['target_top1']:11.2f}",
              flush=True)


if __name__ == "__main__":
    main()
