"""The shipped default model and drafter: intact, loadable, lossless, and actually trained."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.held_out import held_out_prompts
from engine.llm import DEFAULT_DRAFT, DEFAULT_MODEL

MODELS = DEFAULT_MODEL.parent
SUMS = MODELS / "SHA256SUMS"


def _recorded() -> dict[str, str]:
    out = {}
    for line in SUMS.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        out[name.lstrip("*")] = digest
    return out


def test_shipped_files_match_their_checksums():
    recorded = _recorded()
    # NOTE: models/README.md (the recipe, prose) is documentation, not a checkpoint file
    shipped = sorted(p.relative_to(MODELS).as_posix() for p in MODELS.rglob("*")
                     if p.is_file() and p not in (SUMS, MODELS / "README.md"))
    assert shipped == sorted(recorded), "files under models/ differ from SHA256SUMS"
    for name, digest in recorded.items():
        assert hashlib.sha256((MODELS / name).read_bytes()).hexdigest() == digest, name
    total = sum((MODELS / n).stat().st_size for n in recorded)
    assert total <= 16 * 2**20, f"models/ holds {total / 2**20:.1f} MiB, over 16 MiB"


def test_checkpoint_is_a_real_sharded_bf16_checkpoint():
    index = json.loads((DEFAULT_MODEL / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    from safetensors import safe_open

    dtypes = set()
    for shard in shards:
        with safe_open(str(DEFAULT_MODEL / shard), framework="pt") as f:
            for k in f.keys():
                if not k.endswith("e_score_correction_bias"):
                    dtypes.add(f.get_tensor(k).dtype)
    assert dtypes == {torch.bfloat16}
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert cfg["rope_scaling"]["type"] == "yarn"
    assert cfg["n_routed_experts"] > 1 and cfg["n_shared_experts"] == 1
    assert cfg["first_k_dense_replace"] == 1
    draft = json.loads((DEFAULT_DRAFT / "config.json").read_text())
    assert draft["block_size"] in (8, 16) and draft["num_hidden_layers"] in (1, 2)


def test_loads_in_transformers_with_our_logits():
    from transformers import DeepseekV3ForCausalLM

    from engine.models.kimi import KimiForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    ours = KimiForCausalLM.from_dir(DEFAULT_MODEL, progress=False)
    ids = torch.tensor([list(range(300, 340))])
    with torch.no_grad():
        ref = hf(ids).logits
        got, _ = ours(ids)
    assert (got - ref).abs().max().item() < 1e-3


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return held_out_prompts(3, seed=1)


def test_default_tree_equals_ar_and_accepts_long_paths(prompts):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar = LLM(mode="ar", progress=False).generate(prompts, params)
    tree_llm = LLM(mode="tree", budget=16, max_batch_size=2, progress=False)
    tree = tree_llm.generate(prompts, params)
    assert [o.token_ids for o in tree] == [o.token_ids for o in ar]
    # A random drafter is accepted about once per step; the trained one far more often.
    assert tree_llm.stats["mean_accept_len"] > 2.5
    # The text looks like its training domain: indented Python with docstrings or statements.
    for o in ar:
        assert o.text.startswith("    ") and o.text.isascii()
        assert any(k in o.text for k in ('"""', "self.", "return", "if ", " = ", "(")), o.text


def test_generate_cli_uses_the_default(tmp_path):
    from engine.generate import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("def main():\nclass Config:\n")
    out = tmp_path / "out.jsonl"
    main(["--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "12",
          "--ignore-eos"])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    assert all(len(r["token_ids"]) == 12 and r["text"] for r in rows)
