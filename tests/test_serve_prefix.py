"""The prefix cache through the server on the bundled pair: multi-turn sessions that only append
(completions and chat) give a `--no-enable-prefix-caching` server's answers, greedy and seeded,
with `usage.prompt_tokens_details.cached_tokens` covering the previous turn's prompt in whole
pages (0 on the uncached server, streamed usage too); `cache_salt` keeps prefixes apart; the
Prometheus counters add up to the answers' usage. Only 127.0.0.1 is contacted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from engine.llm import LLM  # noqa: E402
from engine.serve.app import build_app  # noqa: E402
from tests.test_serve import serving  # noqa: E402

PAGE = 16


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[bool, str]]:
    with (serving(build_app(LLM(progress=False, max_batch_size=4), "kimi-mini")) as on,
          serving(build_app(LLM(progress=False, max_batch_size=4, enable_prefix_caching=False),
                            "kimi-mini")) as off):
        yield {True: on, False: off}


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("kimi_prefix_cache") or line.startswith("kimi_kv_pages_cached"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


SYSTEM = "You write Python for a build tool. Keep functions short and typed. " * 6


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_a_chat_session_hits_its_previous_turns(urls, sampling):
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "def load_config(path):" + str(sampling)}]
    prev = 0
    for turn in range(3):
        got = {c: post(urls[c], "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 16, **sampling}) for c in (True, False)}
        answer = got[True]["choices"][0]["message"]["content"]
        assert answer == got[False]["choices"][0]["message"]["content"]
        usage = {c: got[c]["usage"] for c in got}
        assert usage[False]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = usage[True]["prompt_tokens_details"]["cached_tokens"]
        if turn:  # the previous turn's prompt, in whole pages, less at most one page
            assert cached >= prev // PAGE * PAGE - PAGE and cached % PAGE == 0
        prev = usage[True]["prompt_tokens"]
        msgs += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": f"tool result {turn}: ok"}]


def test_completions_that_append_hit_and_stream_their_usage(urls):
    prompt = "import os\nimport sys\n\n" + "def main():\n    pass\n" * 20
    before = metrics(urls[True])
    seen = []
    for turn in range(3):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        texts = {c: post(urls[c], "/v1/completions", body) for c in (True, False)}
        assert texts[True]["choices"][0]["text"] == texts[False]["choices"][0]["text"]
        seen.append(texts[True]["usage"])
        prompt += texts[True]["choices"][0]["text"] + f"\n# turn {turn}\n"
    assert seen[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(u["prompt_tokens_details"]["cached_tokens"] >= seen[i]["prompt_tokens"] - 2 * PAGE
               for i, u in enumerate(seen[1:]))
    after = metrics(urls[True])
    d = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_total")}
    assert d["kimi_prefix_cache_queries_total"] == sum(u["prompt_tokens"] for u in seen)
    assert d["kimi_prefix_cache_hits_total"] == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in seen)
    assert after["kimi_kv_pages_cached"] > 0
    # streamed: the usage chunk carries the cached tokens
    with httpx.stream("POST", urls[True] + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: {")]
    import json

    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 2 * PAGE


def test_a_salt_keeps_a_prefix_to_its_own_requests(urls):
    prompt = "class Cache:\n    def __init__(self):\n" * 8
    url = urls[True]

    def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 2, **({"cache_salt": salt} if salt else {})}
        return post(url, "/v1/completions", body)["usage"]["prompt_tokens_details"][
            "cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another salt: nothing
    assert cached(None) == 0  # no salt: nothing either
    assert cached("tenant-a") > 0  # the same salt hits (the pair makes the test)
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "cache_salt": ""}, timeout=30)
    assert r.status_code == 400 and "cache_salt" in r.text


def test_n_choices_report_the_prompt_once(urls):
    body = {"prompt": "def fib(n):\n" * 12, "max_tokens": 6, "n": 3, "temperature": 0.9,
            "seed": 1}
    a = post(urls[True], "/v1/completions", body)
    b = post(urls[False], "/v1/completions", body)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # choice 0 prefilled it
    h = httpx.get(urls[True] + "/health", timeout=30).json()
    assert h["kv_pages_cached"] > 0 and h["kv_pages_free"] == h["kv_pages_total"]
