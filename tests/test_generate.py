"""python -m engine.generate: prompt files, output JSONL, clear errors naming the line."""

from __future__ import annotations

import json

import pytest

from engine.generate import main
from engine.tools.make_draft import make_draft
from engine.tools.make_tiny import make_tiny


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
                            "accept_lengths"}
    txt = tmp_path / "p.txt"
    txt.write_text("one\ntwo\n")
    assert main(["--model", str(t), "--mode", "ar", "--prompts", str(txt), "--output",
                 str(out), "--max-new-tokens", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "a"}\n{"temperature": 0.5}\n', ":2: needs exactly one of"),
    ('{"prompt_token_ids": [1, "x"]}\n', ":1: 'prompt_token_ids' must be a non-empty list of int"),
    ('{"prompt": "a"}\n\n{"prompt": "b"}\n', ":2: empty line"),
    ('{"prompt": "a"}\n{oops\n', ":2: invalid JSON"),
    ('{"prompt": "a", "temperature": -1}\n', ":1: temperature must be >= 0"),
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
