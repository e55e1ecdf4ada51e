"""Train the bundled target: a small Kimi-architecture model on the Python standard library.

    python -m tools.train_target --out models/kimi-mini [--steps 1500] [--seed 0]

One command, fixed seed: trains a byte-level BPE tokenizer on the corpus's train split, then the
model (MLA with YaRN, noaux_tc MoE with a shared expert and a dense first layer) with AdamW, and
writes a real checkpoint: `config.json`, bf16 safetensors shards with an index, Kimi-format
tokenizer files, `training.json` (the command, the corpus manifest, the loss curve and the
held-out loss) and `held_out.jsonl` (the prompts cut from the held-out files, which benchmarks
and profiles read through `engine.held_out`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.held_out import write_candidates
from engine.models.kimi import KimiForCausalLM, MoE, Router
from engine.tokenizer import Tokenizer, write_tokenizer_files
from tools import corpus
from tools.make_tiny import NUM_SPECIAL, save_checkpoint, tiny_config
from tools.train_tokenizer import train_bpe


def mini_config(vocab: int, layers: int = 16, hidden: int = 128) -> dict[str, Any]:
    """The bundled model's shape: at the defaults about 5.0M parameters (10 MB in bf16), 16
    narrow layers (1 dense), 8 routed experts (2 per token) plus a shared one, 4 MLA heads, YaRN
    over a 512-token original context. Other widths scale the inner sizes (all but the head
    count and the rope dim) with `hidden`."""
    u = hidden // 16  # 8 at the default width
    return tiny_config(
        layers=layers, hidden=hidden, vocab=vocab, experts=8, experts_per_tok=2, first_dense=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=8 * u, kv_lora_rank=8 * u,
        qk_nope_head_dim=2 * u, qk_rope_head_dim=16, v_head_dim=2 * u, intermediate_size=48 * u,
        moe_intermediate_size=8 * u, max_position_embeddings=4096,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def init_weights(model: KimiForCausalLM, seed: int) -> None:
    """GPT-2 style: N(0, 0.02), residual outputs scaled by 1/sqrt(2 * layers), norms 1; drawn
    checkpoint tensor by checkpoint tensor, in module order."""
    g = torch.Generator().manual_seed(seed)
    n = model.cfg.num_hidden_layers
    with torch.no_grad():
        for name, s in model.checkpoint_tensors().items():
            if s.dest.dim() == 1:
                s.dest.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n) if name.endswith(("o_proj.weight",
                                                                "down_proj.weight")) else 0.02
                s.dest.copy_(torch.randn(s.shape, generator=g) * std)
        for m in model.modules():
            if isinstance(m, MoE):
                m.gate.weight.normal_(0.0, 0.02, generator=g)
                m.gate.e_score_correction_bias.zero_()


def encode_corpus(tok: Tokenizer, docs: list[tuple[str, str]]) -> torch.Tensor:
    """One long stream: `[BOS] file [EOS]` per file."""
    bos, eos = tok.bos_id, tok.eos_id
    ids: list[int] = []
    for _, text in docs:
        ids += [bos, *tok.encode(text), eos]
    return torch.tensor(ids, dtype=torch.int64)


def lm_loss(model: KimiForCausalLM, x: torch.Tensor) -> torch.Tensor:
    # bf16 autocast: about 2x faster than fp32 on CPUs with AVX512-BF16; master weights stay fp32
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits, _ = model(x[:, :-1], moe="sparse")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def record_expert_loads(model: KimiForCausalLM, loads: list[torch.Tensor]) -> None:
    """Each forward appends every MoE layer's tokens per expert to `loads` (router hooks)."""
    def hook(router: Router, _: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        loads.append(torch.bincount(out[0].reshape(-1),
                                    minlength=router.cfg.n_routed_experts).float())

    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(hook)


def balance_routers(model: KimiForCausalLM, loads: list[torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's selection bias toward
    the mean load."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    with torch.no_grad():
        for m, load in zip(moes, loads):
            m.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


@torch.no_grad()
def eval_loss(model: KimiForCausalLM, data: torch.Tensor, seq: int, batches: int = 8) -> float:
    n = (len(data) - 1) // (seq + 1)
    rows = torch.arange(min(n, batches * 8))
    xs = torch.stack([data[i * (seq + 1):(i + 1) * (seq + 1)] for i in rows])
    return sum(lm_loss(model, xs[i:i + 8]).item() for i in range(0, len(xs), 8)) / math.ceil(
        len(xs) / 8)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.train_target",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab", type=int, default=3072, help="vocabulary incl. 256 specials")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (the first dense)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (multiple of 16)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t_start = time.time()

    train_docs, held_docs = corpus.read_split("train"), corpus.read_split("held_out")
    print(f"corpus: {len(train_docs)} train files, {len(held_docs)} held-out files "
          f"(Python {sys.version.split()[0]} standard library)", flush=True)
    ranks = train_bpe((t for _, t in train_docs), a.vocab - NUM_SPECIAL)
    write_tokenizer_files(a.out, ranks, num_reserved_special=NUM_SPECIAL)
    tok = Tokenizer.from_dir(a.out)
    train, held = encode_corpus(tok, train_docs), encode_corpus(tok, held_docs)
    print(f"tokenizer: {len(ranks)} ranks; {len(train):,} train / {len(held):,} held-out "
          f"tokens ({time.time() - t_start:.0f} s)", flush=True)

    conf = mini_config(a.vocab, a.layers, a.hidden)
    conf["bos_token_id"], conf["eos_token_id"] = tok.bos_id, tok.eos_id
    cfg = ModelConfig.from_dict(conf)
    model = KimiForCausalLM(cfg)
    init_weights(model, a.seed)
    model.train()
    loads: list[torch.Tensor] = []
    record_expert_loads(model, loads)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    warm = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / a.steps, 1.0)))))
    g = torch.Generator().manual_seed(a.seed)
    curve: list[tuple[int, float]] = []
    t0 = time.time()
    for step in range(a.steps):
        starts = torch.randint(0, len(train) - a.seq - 1, (a.batch,), generator=g)
        x = torch.stack([train[s:s + a.seq + 1] for s in starts.tolist()])
        loads.clear()
        loss = lm_loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        balance_routers(model, loads, 1e-3)
        if step % 50 == 0 or step == a.steps - 1:
            curve.append((step, round(loss.item(), 4)))
            el = time.time() - t0
            eta = el / (step + 1) * (a.steps - step - 1)
            print(f"step {step}/{a.steps} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}"
                  f" {el:.0f}s elapsed, eta {eta:.0f}s", flush=True)
    model.eval()
    held_loss = eval_loss(model, held, a.seq)
    print(f"held-out loss {held_loss:.3f} nats/token", flush=True)

    state = {k: s.dest for k, s in model.checkpoint_tensors().items()}
    save_checkpoint(state, conf, a.out, shards=2, dtype=torch.bfloat16)
    record = {
        "command": "python -m tools.train_target " + " ".join(argv or sys.argv[1:]),
        "seed": a.seed, "steps": a.steps, "batch": a.batch, "seq": a.seq, "lr": a.lr,
        "precision": "bf16 autocast, fp32 master weights",
        "torch": torch.__version__, "seconds": round(time.time() - t_start),
        "train_tokens": len(train), "held_out_tokens": len(held),
        "tokens_seen": a.steps * a.batch * a.seq, "loss_curve": curve,
        "held_out_loss": round(held_loss, 4), "corpus": corpus.manifest(),
    }
    (a.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    write_candidates(a.out / "held_out.jsonl", corpus.held_out_candidates())
    print(f"wrote {a.out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
