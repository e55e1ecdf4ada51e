"""Starting and stopping `python -m engine.serve` as an operator expects, on the bundled model:
Ctrl-C (SIGINT) with answers open ends within a few seconds, exit status 0, every open stream
ending with its last chunk and `data: [DONE]`, a whole answer still answered, nothing logged at
ERROR level; a port already in use fails at once, clearly, before anything says it serves."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from engine.llm import DEFAULT_DRAFT, DEFAULT_MODEL  # noqa: E402
from engine.serve.procs import SHUTDOWN_GRACE_S  # noqa: E402
from tests.test_serve import REPO, _start, _stop  # noqa: E402

STOP_WITHIN_S = 5.0  # from the signal to the exit, answers open


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="signals as on Linux")
def test_ctrl_c_with_answers_open(tmp_path: Path) -> None:
    s = _start((DEFAULT_MODEL, DEFAULT_DRAFT), tmp_path / "server.log", "--max-model-len", "4096")
    try:
        # long answers: still open when the grace is over
        body = {"prompt": "def main():", "max_tokens": 4000, "ignore_eos": True}
        whole: dict[str, httpx.Response] = {}
        waiter = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
            f"{s.url}/v1/completions", json=body, timeout=30)))
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines)]
            waiter.start()
            deadline = time.monotonic() + 30
            while s.health()["active"] < 2:  # the whole answer's request is in too
                assert time.monotonic() < deadline, s.health()
                time.sleep(0.05)
            signaled = time.monotonic()
            s.proc.send_signal(signal.SIGINT)
            got += [x for x in lines if x]
        ended = time.monotonic() - signaled
        code = s.proc.wait(STOP_WITHIN_S + 10)
        stopped = time.monotonic() - signaled
        waiter.join(10)
    finally:
        _stop(s)
    log = s.log.read_text()
    assert code == 0, log[-3000:]
    assert stopped < STOP_WITHIN_S, (stopped, log[-3000:])
    assert SHUTDOWN_GRACE_S - 0.5 < ended < STOP_WITHIN_S, ended
    # the stream ended as a stream ends: its last chunk says why, then [DONE]
    assert got[-1] == "data: [DONE]", got[-3:]
    last = json.loads(got[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    assert sum(len(json.loads(x[6:])["choices"][0]["text"]) for x in got[:-1]) > 0
    # the whole answer came back too, with what was generated
    answer = whole["r"].json()
    assert whole["r"].status_code == 200 and answer["choices"][0]["finish_reason"] == "abort"
    assert answer["usage"]["completion_tokens"] > 0
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def test_a_port_in_use_fails_at_once(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "engine.serve", "--port", str(port),
                            "--compile", "off"], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in out and "in use" in out, out[-2000:]
    assert "serving" not in out and "loading weights" not in out, out[-2000:]
