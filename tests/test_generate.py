"""python -m engine.generate: prompt files, output JSONL, clear errors naming the line."""

from __future__ import annotations

import json

import pytest

from engine.generate import main
from tools.make_draft import make_draft
from tools.make_tiny import make_tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    t = make_tiny(root / "t", dtype="fp32")
    return t, make_draft(t, root / "d")


def test_generate_jsonl_and_txt(pair, tmp_path):
    t, d = pair
    pf = tmp_path / "p.jsonl"
    pf.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "hello"}, {"prompt_token_ids": [5, 6, 7]},
        {"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 3},
        {"prompt": "x", "temperature": 0.7, "seed": 3}]) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["--model", str(t), "--draft", str(d), "--prompts", str(pf), "--output", str(out),
                 "--max-new-tokens", "6", "--ignore-eos"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert len(rows[2]["token_ids"]) == 3 and len(rows[0]["token_ids"]) == 6
    assert set(rows[0]) == {"index", "text", "token_ids", "finish_reason", "num_steps",
                            "accept_lengths", "cached_tokens"}
    txt = tmp_path / "p.txt"
    txt.write_text("one\ntwo\n")
    assert main(["--model", str(t), "--mode", "ar", "--prompts", str(txt), "--output",
                 str(out), "--max-new-tokens", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "a"}\n{"temperature": 0.5}\n', ":2: needs exactly one of"),
    ('{"prompt_token_ids": [1, "x"]}\n', ":1: prompt_token_ids.1: Input should be a valid int"),
    ('{"prompt": "a"}\n\n{"prompt": "b"}\n', ":2: empty line"),
    ('{"prompt": "a"}\n{oops\n', ":2: invalid JSON"),
    ('{"prompt": "a", "temperature": -1}\n', ":1: temperature: Input should be greater than or "
                                              "equal to 0"),
    ('{"prompt": "a", "colour": 1}\n', ":1: unknown field"),
    ('{"prompt_token_ids": [' + ",".join(["5"] * 5000) + "]}\n", ":1: the prompt has 5000 tokens"),
])
def test_bad_prompt_files_name_the_line(pair, tmp_path, capsys, content, needle):
    t, d = pair
    pf = tmp_path / "bad.jsonl"
    pf.write_text(content)
    out = tmp_path / "o.jsonl"
    rc = main(["--model", str(t), "--draft", str(d), "--prompts", str(pf), "--output", str(out),
               "--max-model-len", "512"])
    assert rc == 2
    assert needle in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "o.jsonl.partial").exists()


def test_readme_default_job_on_a_fresh_clone(tmp_path):
    """The README's default command, run as a newcomer runs it: in a copy of what is committed
    (no `runs/` folder), from the repository root."""
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    readme = (repo / "README.md").read_text()
    cmd = re.search(r"^python -m engine\.generate --prompts examples/\S+ --output (\S+)$",
                    readme, re.M)
    assert cmd, "the README shows its default job"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    clone = tmp_path / "clone"
    for f in files:
        if (repo / f).is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / f, clone / f)
    assert not (clone / "runs").exists()
    r = subprocess.run([sys.executable, *cmd.group(0).split()[1:]], cwd=clone,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (clone / cmd.group(1)).read_text().splitlines()]
    prompts = (clone / "examples" / "prompts.jsonl").read_text().splitlines()
    assert [r["index"] for r in rows] == list(range(len(prompts)))
    assert not (clone / (cmd.group(1) + ".partial")).exists()


def test_unwritable_output_fails_before_loading(pair, tmp_path, capsys):
    t, d = pair
    pf = tmp_path / "p.txt"
    pf.write_text("hello\n")
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = main(["--model", str(tmp_path / "no-model-here"), "--prompts", str(pf), "--output",
               str(blocker / "out.jsonl")])
    assert rc == 2
    assert "cannot write there" in capsys.readouterr().err  # not the missing model


def test_a_failure_late_in_the_run_keeps_finished_results(pair, tmp_path, monkeypatch):
    """Results are written as they finish: when the engine fails after some requests are done,
    they are in OUT.partial."""
    from engine.scheduler import Scheduler

    t, d = pair
    pf = tmp_path / "p.jsonl"
    pf.write_text("\n".join(json.dumps({"prompt_token_ids": [5, 6, 7], "max_new_tokens": n})
                            for n in (1, 2, 40)) + "\n")
    real_step = Scheduler.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected failure")
        return real_step(self)

    monkeypatch.setattr(Scheduler, "step", step)
    out = tmp_path / "o.jsonl"
    with pytest.raises(RuntimeError, match="injected failure"):
        main(["--model", str(t), "--mode", "ar", "--prompts", str(pf), "--output", str(out),
              "--ignore-eos", "--max-batch-size", "4"])
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl.partial").read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1]
    assert [len(r["token_ids"]) for r in sorted(rows, key=lambda r: r["index"])] == [1, 2]
    assert not out.exists()
