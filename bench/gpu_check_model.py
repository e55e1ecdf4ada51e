"""The GPU check's checkpoint pair: a tiny random target stored as Kimi K2.5 stores its weights
(bf16, routed experts INT4 pack-quantized) with Kimi's attention widths, and a random DFlash
drafter for it. The check writes it at run time (it is generated, not carried).

    python -m bench.gpu_check_model --out DIR    # DIR/target and DIR/draft

Kimi's widths are where the GPU path chooses its kernels: an MLA latent of 512 plus a rope
part of 64 (what flashinfer's fa2/fa3 MLA kernels plan; the paged Triton kernels' Kimi
tiles), 128 nope and 128 value dims per head, INT4 groups of 32 (the Triton W4A16 expert
GEMMs). The rest stays small so it is written and loaded in about a second: 4 heads, hidden
256, 3 layers (one dense, two MoE of 8 routed experts, 2 per token), a vocabulary of 1024,
and a one-layer drafter with Kimi's block of 8.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tools.make_draft import make_draft
from tools.make_tiny import make_tiny

# `tools.make_tiny.tiny_config` options: Kimi's attention widths at a few heads.
TARGET: dict[str, Any] = dict(
    layers=3, hidden=256, vocab=1024, experts=8, experts_per_tok=2, first_dense=1,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128)
DRAFT_BLOCK = 8  # Kimi-K2.5-DFlash's block size


def write_pair(root: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Write the target to `root/target` and its drafter to `root/draft` (unless the
    directory already holds them) and return the two directories."""
    root = Path(root)
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").is_file():
        make_tiny(target, seed=seed, int4_experts=True, dtype="bf16", **TARGET)
    if not (draft / "config.json").is_file():
        make_draft(target, draft, layers=1, block_size=DRAFT_BLOCK, seed=seed + 1)
    return target, draft


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check_model",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="writes OUT/target and OUT/draft")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for path in write_pair(a.out, a.seed):
        print(path)


if __name__ == "__main__":
    main()
