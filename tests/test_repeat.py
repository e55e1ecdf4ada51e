"""`graphs.repeat`: a run of identical layers costed from two of them gives the counts of running
every layer, in the cost rows (steps, prefill chunks, a turn over a cached prefix, under TP)
and in the rehearsal's tallies (peaks, launches, syncs)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from graphs import plan
from graphs.repeat import combine, repeated, sampled

MODELS = Path(__file__).resolve().parent.parent / "models"


def same(x: Any, y: Any, path: str = "") -> None:
    """Equal, floats to rounding (a sum taken in another order)."""
    if isinstance(x, dict):
        assert set(x) == set(y), (path, set(x) ^ set(y))
        for k in x:
            same(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, list) and x and isinstance(x[0], dict) and "dtype" in x[0]:
        same({(o["name"], o["dtype"]): o for o in x}, {(o["name"], o["dtype"]): o for o in y},
             path)
    elif isinstance(x, list | tuple):
        assert len(x) == len(y), path
        for i, (a, b) in enumerate(zip(x, y)):
            same(a, b, f"{path}[{i}]")
    elif isinstance(x, float):
        assert math.isclose(x, y, rel_tol=1e-9), (path, x, y)
    else:
        assert x == y, (path, x, y)


@pytest.fixture(scope="module")
def six(tmp_path_factory) -> list[str]:
    """The bundled pair's configs at 6 target layers (one dense, five MoE), the drafter fed by
    layers 1, 3 and 5 (two of them inside the sampled run)."""
    root = tmp_path_factory.mktemp("six")
    t = json.loads((MODELS / "kimi-mini" / "config.json").read_text())
    d = json.loads((MODELS / "kimi-mini-dflash" / "config.json").read_text())
    t["num_hidden_layers"] = d["num_target_layers"] = 6
    d["dflash_config"]["target_layer_ids"] = [1, 3, 5]
    for name, cfg in (("t", t), ("d", d)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return ["--model", str(root / "t"), "--draft", str(root / "d")]


@pytest.fixture(scope="module")
def mini_tp2(six) -> tuple[plan.Models, plan.CountingGroup]:
    return plan.build(Path(six[1]), Path(six[3]), 2, torch.bfloat16)


def test_the_moe_layers_repeat_and_pass_through_on_meta_only(mini_tp2):
    models, _ = mini_tp2
    layers = models.target.model.layers
    assert repeated(layers) == list(range(1, 6))  # the dense first layer differs
    assert repeated(layers[:3]) == []  # two alike are not worth sampling
    with sampled(layers, list(range(1, 6)), 1):
        with pytest.raises(RuntimeError, match="meta device only"):
            layers[3]([torch.zeros(1, 2, 128), None], None, "dense")
    assert "forward" not in vars(layers[3])  # restored
    assert combine({"a": 3, "ops": [], "peak": 5}, {"a": 5, "b": 1, "ops": [], "peak": 7}, 4) \
        == {"a": 11, "b": 4, "ops": [], "peak": 7}


def test_costs_from_two_layers_equal_every_layers(mini_tp2, six):
    models, _ = mini_tp2
    got = {}
    for every in (False, True):
        a = plan.build_parser().parse_args([
            *six, "--tp", "2", "--cost", "--batch-sizes", "2", "--budgets", "4", "--context",
            "256", "--prompt-lens", "300", "--prefill-chunk", "128", "--cached-turn", "64,192",
            *(["--every-layer"] if every else [])])
        got[every] = {"rows": plan.costs(a, models, torch.bfloat16, ["H200"]),
                      "prefill": plan.prefill_costs(a, models, torch.bfloat16, ["H200"])}
    assert got[True]["rows"][0]["allreduce_calls"] > 0
    same(got[False], got[True])


def test_rehearsals_from_two_layers_equal_every_layers(mini_tp2, six, monkeypatch):
    """The memory table's measured peaks (every captured step, a prompt of two chunks) and a
    rehearsed step's and prefill's launches and syncs, sampled."""
    from graphs.rehearse import DeviceMode, rehearse_prefill, rehearse_step, step_kinds
    from graphs.repeat import extrapolated

    models, group = mini_tp2
    monkeypatch.setattr(plan, "REHEARSE_SAMPLED", 3)
    got = {}
    for every in (False, True):
        a = plan.build_parser().parse_args([*six, "--tp", "2", "--prefill-chunk", "64",
                                            "--max-batch-size", "2",
                                            *(["--every-layer"] if every else [])])
        got[every] = plan.memory(a, models, group, torch.bfloat16, 8 * 10**9)
    same(got[False], got[True])
    z = plan.sizing(a, models, torch.bfloat16, 8 * 10**9, 2)
    runner = plan.engine_runner(models, z, z.pool.num_pages, torch.bfloat16)
    mode = DeviceMode(group)
    name, shape = step_kinds(runner, 2)[-1]
    layers = models.target.model.layers
    runs = [lambda: rehearse_step(mode, runner, 2, shape),
            lambda: rehearse_prefill(mode, runner, prompt_len=150, chunk=64,
                                     num_pages=z.pool.num_pages, max_model_len=z.max_len)]
    for run in runs:
        every, two = run(), extrapolated(layers, run)
        same(every, two)
    # NOTE: the prefill syncs nowhere (its copies to the device do not block), so its syncs
    # compare empty
    assert every[0].launches > 0 and every[0].collectives > 0 and not every[0].syncs
