"""Write a randomly initialized DFlash drafter that fits a target checkpoint.

    python -m tools.make_draft --target DIR --out DIR [--layers N --block-size B --seed S]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.models.dflash import DFlashDrafter, DraftConfig


def spread_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """`n` target layers spread from the second to the second-to-last (DFlash's choice)."""
    if num_target_layers <= 2 or n == 1:
        return [num_target_layers // 2] if n == 1 else list(range(min(n, num_target_layers)))
    lo, hi = 1, num_target_layers - 2
    n = min(n, hi - lo + 1)
    return sorted({round(lo + (hi - lo) * i / max(n - 1, 1)) for i in range(n)})


def mask_token_for(target_dir: Path, cfg: ModelConfig) -> int:
    tc = target_dir / "tokenizer_config.json"
    if tc.is_file():
        added = json.loads(tc.read_text()).get("added_tokens_decoder", {})
        for i, tok in added.items():
            if tok.get("content") == "[UNK]":
                return int(i)
    return cfg.vocab_size - 1


def draft_config(target_dir: Path, layers: int = 1, block_size: int = 8,
                 num_target_features: int = 3,
                 target_layer_ids: list[int] | None = None,
                 intermediate_size: int | None = None) -> dict[str, Any]:
    """A drafter config for the target in `target_dir`: its hidden size and vocabulary, MLPs
    `intermediate_size` wide (default twice the hidden size)."""
    cfg = ModelConfig.from_dir(target_dir)
    if target_layer_ids is None:
        target_layer_ids = spread_layer_ids(cfg.num_hidden_layers, num_target_features)
    bad = [i for i in target_layer_ids if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"target layer ids {bad} outside the target's "
                         f"{cfg.num_hidden_layers} layers")
    H = cfg.hidden_size
    heads = max(1, cfg.num_attention_heads)
    head_dim = max(8, H // heads)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2) if heads % 2 == 0 else heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size or 2 * H,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "block_size": block_size,
        "num_target_layers": cfg.num_hidden_layers,
        "dflash_config": {
            "target_layer_ids": sorted(target_layer_ids),
            "mask_token_id": mask_token_for(target_dir, cfg),
        },
        "torch_dtype": "bfloat16",
    }


def make_draft(target: str | Path, out: str | Path, *, layers: int = 1, block_size: int = 8,
               seed: int = 0, std: float = 0.05) -> Path:
    target = Path(target)
    conf = draft_config(target, layers, block_size)
    c = DraftConfig.from_dict(conf)
    torch.manual_seed(seed)
    model = DFlashDrafter(c, ModelConfig.from_dir(target).hidden_size)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.01 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.save(out, conf)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="target checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    path = make_draft(a.target, a.out, layers=a.layers, block_size=a.block_size, seed=a.seed)
    print(f"wrote drafter to {path}")


if __name__ == "__main__":
    main()
