"""Run by tests/test_parallel.py on each of W ranks (torchrun's environment: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): several LLM runs across the tensor-parallel group.

    torchrun --nproc-per-node W tests/tp_run.py SPEC.json OUT_DIR

SPEC.json: {"model", "draft", "tp", "prompts": [[ids...]], "runs": [{"mode", "budget",
"max_new_tokens", "temperature", "top_p", "seed", "oracle", "prefill_chunk", "repeat", and
"model", "draft", "prompts" where a run has its own}]}. Every rank writes
OUT_DIR/rank{r}.json with its parameter bytes per run and whether its process groups were
really freed on leaving them; rank 0 also writes each run's token ids.
With "oracle", the drafter is the test suite's oracle (it agrees with the target often, so steps
accept several tokens); it runs the target, so its collectives line up on every rank.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

import engine.spec as spec_module
from engine import LLM, SamplingParams
from engine.dist import leave_default_group
from engine.models.layers import param_bytes
from tests.spec_helpers import oracle_draft


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    torch.set_num_threads(1)
    results = []
    plain_draft = spec_module.draft
    for run in spec["runs"]:
        spec_module.draft = oracle_draft() if run.get("oracle") else plain_draft
        model, draft = run.get("model", spec["model"]), run.get("draft", spec["draft"])
        prompts = run.get("prompts", spec["prompts"])
        llm = LLM(model, draft if run["mode"] != "ar" else None,
                  mode=run["mode"], budget=run.get("budget", 8), tp=spec["tp"],
                  max_batch_size=4, max_model_len=256, progress=False,
                  prefill_chunk=run.get("prefill_chunk"),
                  tp_timeout=spec.get("tp_timeout", 60.0))
        params = SamplingParams(temperature=run.get("temperature", 0.0),
                                top_p=run.get("top_p", 1.0), seed=run.get("seed"),
                                max_new_tokens=run["max_new_tokens"], ignore_eos=True)
        for _ in range(run.get("repeat", 1)):  # again: the prompts hit the prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        target = param_bytes(llm.models.target)
        drafter = param_bytes(llm.models.drafter) if llm.models.drafter is not None else (0, 0)
        results.append({"tokens": [o.token_ids for o in outs], "target_bytes": target,
                        "drafter_bytes": drafter,
                        "all_reduce_calls": llm.tp.comm.calls["all_reduce"],
                        "mean_accept_len": llm.stats.get("mean_accept_len", 0.0),
                        "cached": [o.cached_tokens for o in outs]})
        control = weakref.ref(llm.tp.control)
        llm.close()
        # a process group still referenced keeps its worker threads into interpreter exit
        results[-1]["control_group_left"] = control() is None
    world = weakref.ref(dist.group.WORLD)
    leave_default_group()  # what runs at exit
    results[-1]["default_group_left"] = world() is None
    (out / f"rank{llm.tp.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
