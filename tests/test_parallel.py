"""Tensor parallelism on the CPU (gloo): sharding rules in-process, and runs of several ranks
(the CLIs under torchrun, the rest in its environment, forked: `tests.forked`) that must give
exactly the single-process tokens, hold about 1/N of the weights per rank, and fail fast when a
rank dies or freezes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import engine.spec as spec
from engine import LLM, SamplingParams
from engine.config import DraftConfig, ModelConfig
from engine.dist import Group
from engine.generate import main as generate_main
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from engine.models.layers import checkpoint_tensors, param_bytes
from tests import forked
from tests.spec_helpers import TARGETS, make_pair, oracle_draft
from tests.test_chunked_prefill import PAGE, ids
from tools.make_draft import make_draft
from tools.make_tiny import make_tiny

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
BUNDLED = REPO / "models" / "kimi-mini", REPO / "models" / "kimi-mini-dflash"
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42, 43, 44, 45, 46, 47, 48, 49]]
RUNS = [
    {"mode": "tree", "max_new_tokens": 10, "oracle": True},
    {"mode": "chain", "max_new_tokens": 10, "oracle": True},
    {"mode": "ar", "max_new_tokens": 10},
    {"mode": "tree", "max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 7,
     "oracle": True},
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # hidden 64: 4 heads, intermediate 128, expert intermediate 32, vocab 768: all divide by 4
    return make_pair(tmp_path_factory.mktemp("tp"), "moe_groups_yarn")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{TESTS}")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def torchrun(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-addr", "127.0.0.1", "--master-port", str(_port()), *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def single(model, draft, run) -> tuple[list[list[int]], tuple[int, int], tuple[int, int]]:
    plain = spec.draft
    spec.draft = oracle_draft() if run.get("oracle") else plain
    try:
        llm = LLM(model, draft if run["mode"] != "ar" else None, mode=run["mode"],
                  budget=run.get("budget", 8), max_batch_size=4, max_model_len=256,
                  progress=False)
        params = SamplingParams(temperature=run.get("temperature", 0.0),
                                top_p=run.get("top_p", 1.0), seed=run.get("seed"),
                                max_new_tokens=run["max_new_tokens"], ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    finally:
        spec.draft = plain
    d = llm.models.drafter
    return ([o.token_ids for o in outs], param_bytes(llm.models.target),
            param_bytes(d) if d is not None else (0, 0))


@pytest.fixture(scope="module")
def singles(pair) -> list[tuple[list[list[int]], tuple[int, int], tuple[int, int]]]:
    """`single` of each of `RUNS` on `pair`: what every tensor-parallel size must equal."""
    return [single(*pair, run) for run in RUNS]


def run_tp(n: int, model: Path, draft: Path, runs: list[dict], tmp: Path) -> list[list[dict]]:
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps({"model": str(model), "draft": str(draft), "tp": n,
                                     "prompts": PROMPTS, "runs": runs}))
    out = tmp / "out"
    out.mkdir()
    # NOTE: the ranks started by hand, without torchrun's agent (a process more on two cores),
    # forked: the CLIs' own tests below run under torchrun, each rank a process of its own
    procs = _launch(n, [str(TESTS / "tp_run.py"), str(spec_file), str(out)], tmp)
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p, _ in procs):
        failed = [err for p, err in procs if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p, _ in procs:
                p.kill()
            raise AssertionError((failed or [procs[0][1]])[0].read_text()[-4000:])
        time.sleep(0.1)
    for p, err in procs:
        assert p.wait() == 0, err.read_text()[-4000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(n)]


def check_sharded_bytes(n: int, full: tuple[int, int], got: list[int]) -> None:
    """`got = [this rank's bytes, its replicated bytes]`: replicated parts whole, the rest 1/n."""
    total, rep = got
    assert total == rep + (full[0] - rep) // n, (full, got)


RUNS_4 = [RUNS[0], RUNS[3]]  # four ranks on two cores: the greedy and the seeded tree

# The bundled pair across 2 ranks, prompts prefilled in chunks of 3 and 5 tokens, greedy and
# seeded (`test_tp_equals_single_process_bundled`; chain and ar run on the test pair).
BUNDLED_RUNS = [
    {"mode": "tree", "max_new_tokens": 16, "prefill_chunk": 3},
    {"mode": "tree", "max_new_tokens": 16, "temperature": 0.8, "seed": 5, "prefill_chunk": 5}]
# Each prompt twice, the second time over the prefix cache (`test_tp2_with_the_cache_equals_one_
# process`).
CACHE_PROMPTS = [ids(40, 40), ids(53, 41)]
CACHE_RUNS = [{"mode": "tree", "max_new_tokens": 12, "repeat": 2},
              {"mode": "tree", "max_new_tokens": 12, "temperature": 0.8, "seed": 5,
               "repeat": 2, "prefill_chunk": 20}]


@pytest.fixture(scope="module")
def tp2(pair, tmp_path_factory) -> list[list[dict]]:
    """One launch of two ranks for every 2-rank comparison: `RUNS` on `pair`, then
    `BUNDLED_RUNS` and `CACHE_RUNS` on the bundled pair (each rank's results, in that order)."""
    bundled = {"model": str(BUNDLED[0]), "draft": str(BUNDLED[1])}
    runs = [*RUNS, *({**r, **bundled} for r in BUNDLED_RUNS),
            *({**r, **bundled, "prompts": CACHE_PROMPTS} for r in CACHE_RUNS)]
    return run_tp(2, *pair, runs, tmp_path_factory.mktemp("tp2"))


@pytest.mark.parametrize("n", [2, 4])
def test_tp_equals_single_process(pair, singles, tp2, tmp_path, n):
    """Greedy tree / chain / ar and seeded sampling give the single-process tokens exactly (at 4
    ranks the greedy and the seeded tree), and each rank holds 1/n of every split tensor (the
    drafter splits at 2 and is replicated at 4, where its 2 KV heads do not divide)."""
    model, draft = pair
    runs = RUNS if n == 2 else RUNS_4
    ranks = [r[:len(RUNS)] for r in tp2] if n == 2 else run_tp(n, model, draft, runs, tmp_path)
    for i, run in enumerate(runs):
        tokens, tbytes, dbytes = singles[RUNS.index(run)]
        assert ranks[0][i]["tokens"] == tokens, run
        for rank in ranks:
            check_sharded_bytes(n, tbytes, rank[i]["target_bytes"])
            # replicated: norms, latent projections, routers; a small share here
            assert rank[i]["target_bytes"][1] < 0.15 * tbytes[0]
            assert rank[i]["target_bytes"][0] < tbytes[0] / n + rank[i]["target_bytes"][1] + 1
            if run["mode"] != "ar":
                if n == 2:
                    check_sharded_bytes(n, dbytes, rank[i]["drafter_bytes"])
                else:
                    assert rank[i]["drafter_bytes"][0] == dbytes[0]
        assert ranks[0][i]["all_reduce_calls"] > 0
        # left groups are freed at once (their threads end), not at interpreter exit
        assert all(rank[i]["control_group_left"] for rank in ranks)
        if run.get("oracle") and not run.get("temperature"):
            # the oracle drafter makes steps accept several tokens, so multi-row commits and
            # drafter-feature handoffs run under TP too
            assert ranks[0][i]["mean_accept_len"] > 1.5
    assert all(rank[-1]["default_group_left"] for rank in (tp2 if n == 2 else ranks))


def test_generate_cli_under_torchrun(tmp_path):
    """The CLI on a sharded K2.5-style checkpoint with INT4 experts (each rank slices the
    dequantized experts) and a vision tower (each rank encodes the images of its prefills),
    greedy and seeded-sampled lines and a chat line with an image, equals the single-process
    output."""
    from tests.test_vision_prefill import _messages, _png

    model = make_tiny(tmp_path / "t", dtype="fp32", vocab=768, seed=3, int4_experts=True,
                      shards=2, vision=True, **TARGETS["moe_groups_yarn"])
    draft = make_draft(model, tmp_path / "d", layers=1, seed=4)
    pf = tmp_path / "p.jsonl"
    pf.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "hello world"}, {"prompt_token_ids": [5, 6, 7]},
        {"prompt": "x", "temperature": 0.7, "seed": 3},
        {"messages": _messages(_png(100, 30, 2), _png(60, 40, 1))}]) + "\n")
    common = ["--model", str(model), "--draft", str(draft), "--prompts", str(pf),
              "--max-new-tokens", "6", "--ignore-eos", "--max-model-len", "256"]
    ref = tmp_path / "single.jsonl"
    assert generate_main([*common, "--output", str(ref)]) == 0
    out = tmp_path / "tp.jsonl"
    r = torchrun(2, "-m", "engine.generate", "--tp", "2", *common, "--output", str(out))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows == [json.loads(x) for x in ref.read_text().splitlines()]


def _launch(n: int, argv: list[str], tmp: Path) -> list[tuple[forked.Rank, Path]]:
    """`n` ranks of `python argv...` started by hand (torchrun's environment, without its agent
    killing the others when one dies, so the survivors' own behaviour is what a test sees),
    forked from a server that imported torch and the engine once (`tests.forked`); each one's
    stderr in a file."""
    return forked.launch(n, argv, tmp, _port())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_lost_rank_fails_fast(pair, tmp_path, sig):
    """Kill (or freeze) rank 1 mid-run: rank 0 exits with an error naming the problem within a
    bounded time instead of hanging in a collective."""
    model, _ = pair
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    procs = _launch(2, ["-m", "engine.generate", "--tp", "2", "--tp-timeout", "3", "--model",
                        str(model), "--mode", "ar", "--prompts", str(pf), "--output",
                        str(tmp_path / "o.jsonl"), "--max-new-tokens", "5000", "--ignore-eos",
                        "--max-model-len", "6000"], tmp_path)
    (p0, err0), (p1, _) = procs
    try:
        deadline = time.monotonic() + 240
        while "generating" not in err0.read_text():
            assert p0.poll() is None and p1.poll() is None, err0.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        time.sleep(1.0)
        p1.send_signal(sig)
        t0 = time.monotonic()
        rc = p0.wait(timeout=60)
        waited = time.monotonic() - t0
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err = err0.read_text()
    assert rc == 1, err[-3000:]
    assert "error: tensor-parallel rank 0 of 2" in err, err[-3000:]
    if sig == signal.SIGSTOP:
        assert "rank 1 stopped responding" in err
    assert waited < 30
    assert not (tmp_path / "o.jsonl").exists()


def test_serve_under_torchrun(pair, tmp_path):
    """Rank 0 serves HTTP, rank 1 follows; a greedy completion equals the single-process one."""
    import httpx

    model, draft = pair
    ref = LLM(model, draft, max_batch_size=4, max_model_len=256, progress=False)
    want = ref.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    port = _port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_port()), "-m", "engine.serve",
           "--tp", "2", "--model", str(model), "--draft", str(draft), "--port", str(port),
           "--max-batch-size", "4", "--max-model-len", "256", "--log-level", "warning"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_tp_equals_single_process_bundled(tp2):
    """The bundled pair across 2 ranks gives the single process's tokens, prompts prefilled in
    chunks of 3 and 5 tokens against the unchunked single process, greedy and seeded."""
    model, draft = BUNDLED
    ranks = [r[len(RUNS):len(RUNS) + len(BUNDLED_RUNS)] for r in tp2]
    for i, run in enumerate(BUNDLED_RUNS):
        tokens, tbytes, _ = single(model, draft, run)
        assert ranks[0][i]["tokens"] == tokens, run
        for rank in ranks:
            check_sharded_bytes(2, tbytes, rank[i]["target_bytes"])


def test_tp2_with_the_cache_equals_one_process(tp2):
    """Each prompt sent again hits the prefix cache under TP (its whole pages but the last
    token's) and gives the single process's cold tokens, greedy and seeded, prefilled whole or
    in chunks."""
    from tests.test_prefix_cache_model import cold, run

    ranks = [r[len(RUNS) + len(BUNDLED_RUNS):] for r in tp2]
    for i, r in enumerate(CACHE_RUNS):
        llm = LLM(*BUNDLED, mode="tree", max_batch_size=4, max_model_len=256, progress=False,
                  budget=8, prefill_chunk=r.get("prefill_chunk"))
        params = SamplingParams(max_new_tokens=12, ignore_eos=True,
                                temperature=r.get("temperature", 0.0), seed=r.get("seed"))
        with cold(llm):
            ref = run(llm, CACHE_PROMPTS, params)
        assert ranks[0][i]["tokens"] == [o.token_ids for o in ref], r
        assert ranks[0][i]["cached"] == [(len(p) - 1) // PAGE * PAGE for p in CACHE_PROMPTS]


# ---- sharding rules, in-process (no process group needed) ----------------------------------


def test_split_plan_and_shards(pair):
    """A rank's model is built with its share of every split tensor; each tensor says which
    dimension it splits (so the loader reads only that piece) and the checkpoint's whole
    shape."""
    model, draft = pair
    cfg = ModelConfig.from_dir(model)
    tp = Group(1, 2)
    with torch.device("meta"):
        m = KimiForCausalLM(cfg, tp)
        whole = KimiForCausalLM(cfg).checkpoint_tensors()
    t = m.checkpoint_tensors()
    assert m.model.layers[0].self_attn.num_heads == 2
    dims = {n: s.dim for n, s in t.items() if s.dim is not None}
    assert dims["model.layers.0.self_attn.q_b_proj.weight"] == 0
    assert dims["model.layers.0.self_attn.kv_b_proj.weight"] == 0
    assert dims["model.layers.0.self_attn.o_proj.weight"] == 1
    assert dims["model.layers.1.mlp.experts.3.down_proj.weight"] == 1
    assert dims["model.layers.1.mlp.shared_experts.up_proj.weight"] == 0
    assert dims["model.embed_tokens.weight"] == 0 and dims["lm_head.weight"] == 0
    for replicated in ("model.layers.0.self_attn.q_a_proj.weight",
                       "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                       "model.layers.1.mlp.gate.weight", "model.norm.weight",
                       "model.layers.0.input_layernorm.weight"):
        assert replicated not in dims
    for name, s in t.items():
        assert s.shape == whole[name].shape, name
        local = list(s.shape)
        if s.dim is not None:
            local[s.dim] //= 2
        assert tuple(s.dest.shape) == tuple(local), name
    for name, want in (("model.layers.0.self_attn.o_proj.weight", lambda w, n: w[:, n:]),
                       ("model.layers.0.self_attn.q_b_proj.weight", lambda w, n: w[n:]),
                       ("model.norm.weight", lambda w, n: w)):
        s = t[name]
        w = torch.randn(s.shape)
        assert torch.equal(s.piece(w), want(w, s.shape[s.dim or 0] // 2)), name
    # the drafter splits at 2 (4 heads, 2 KV heads) and stays whole at 4
    c = DraftConfig.from_dir(draft)
    with torch.device("meta"):
        d2 = DFlashDrafter(c, cfg.hidden_size, tp)
        d4 = DFlashDrafter(c, cfg.hidden_size, Group(0, 4))
    assert d2.layers[0].self_attn.num_kv_heads == c.num_key_value_heads // 2
    assert d2.kv_dim == c.kv_dim // 2 and d4.kv_dim == c.kv_dim
    assert any(s.dim is not None for s in checkpoint_tensors(d2).values())
    assert all(s.dim is None or s.world == 1 for s in checkpoint_tensors(d4).values())
    assert checkpoint_tensors(d2)["layers.0.self_attn.k_proj.weight"].shape == \
        tuple(DFlashDrafter(c, cfg.hidden_size).state_dict()["layers.0.self_attn.k_proj.weight"]
              .shape)


def test_indivisible_shapes_are_named(pair):
    cfg = ModelConfig.from_dir(pair[0])
    with torch.device("meta"), pytest.raises(ValueError, match="num_attention_heads 4 is not "
                                                               "divisible by the tensor-parallel "
                                                               "size 3"):
        KimiForCausalLM(cfg, Group(0, 3))


def test_tp_needs_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="needs 2 processes started by torchrun"):
        Group.init(2)


def test_presets_are_engine_configs():
    tomllib = pytest.importorskip("tomllib")
    from engine.config import EngineConfig

    for name in ("tp8-nvlink.toml", "tp8-pcie.toml"):
        cfg = EngineConfig(**tomllib.loads((REPO / "configs" / name).read_text())["engine"])
        assert cfg.tp == 8 and cfg.max_batch_size == max(cfg.capture_sizes)
    nv = tomllib.loads((REPO / "configs" / "tp8-nvlink.toml").read_text())["engine"]
    pcie = tomllib.loads((REPO / "configs" / "tp8-pcie.toml").read_text())["engine"]
    assert pcie["budget"] < nv["budget"] and pcie["max_batch_size"] < nv["max_batch_size"]


def test_profile_reports_allreduce_share_under_torchrun(pair, tmp_path):
    """`graphs.profile --tp 2` runs the same eager steps on both ranks and reports how much of
    the step the all-reduces take (rank 0 writes the results)."""
    model, draft = pair
    out = tmp_path / "profile.json"
    r = torchrun(2, "-m", "graphs.profile", "--tp", "2", "--model", str(model), "--draft",
                 str(draft), "--batch-sizes", "1,2", "--steps", "2", "--warmup", "1",
                 "--prompt-len", "8", "--no-progress", "--output", str(out))
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and [x["batch_size"] for x in res["results"]] == [1, 2]
    for row in res["results"]:
        assert 0.0 < row["allreduce_share"] < 1.0
    assert "allred %" in r.stdout
