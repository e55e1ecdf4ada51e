"""Tiny random DeepseekV3ForCausalLM checkpoints made and saved by transformers (the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=24, n_group=1, topk_group=1,
    num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=1024,
    num_nextn_predict_layers=0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "rope_theta": 10000.0}

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "yarn_groups": dict(rope_parameters=YARN, n_group=4, topk_group=2, num_experts_per_tok=3),
    "all_moe": dict(rope_parameters=YARN, first_k_dense_replace=0),
    "two_dense": dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                      first_k_dense_replace=2, q_lora_rank=None),
}


def make_hf_model(out: Path, name: str, seed: int = 0, std: float = 0.08):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**{**BASE, **CONFIGS[name]})
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            else:
                p.normal_(1.0, 0.1)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return model
