"""bench/gpu_check.sh and its helpers, without a GPU: the dry run lists every part with its
budget (the toolchain, the shipping path, the graphs, the Triton kernels in one pytest call,
one Kimi layer at its real size against the cost model, the profile), 420 s in all (the
script's 435 s less its reserve: room for a rerun); the check's test files collect on the CPU (their
non-CUDA tests are the suite's own); a part at its limit gets SIGINT and keeps its JUnit
report, a test over the per-test limit fails alone, a signal to the script stops its part;
the toolchain names each missing package; a flashinfer that imports only in part is not
taken; the profile part attends as asked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from bench import gpu_check_env
from ops import attention_gpu

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.sh"
TOTAL = 435  # the script's TOTAL_BUDGET
PARTS_TOTAL = 420  # the parts' budgets, at most
TRITON_FILES = ["tests/test_paged_attention.py", "tests/test_moe_kernels.py",
                "tests/test_quant_kernels.py"]


def _env(tmp_path: Path, **env: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if not k.endswith("_TIMEOUT") and k not in ("DRY_RUN", "TOTAL_BUDGET")}
    return {**keep, "TMPDIR": str(tmp_path), "SITE_DIR": str(tmp_path / "site"), **env}


def _dry_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, tuple]]:
    """The dry run's output and its parts: name -> (budget, command)."""
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *args],
                       env=_env(tmp_path, DRY_RUN="1"), capture_output=True, text=True,
                       timeout=60)
    parts = {m[1]: (int(m[2]), m[3] or "")
             for m in re.finditer(r"^part: (.+?): budget (\d+)s(?:: (.*))?$", r.stdout, re.M)}
    return r, parts


def _pytest_files(command: str) -> list[str]:
    return re.findall(r"tests/\S+\.py", command)


def test_gpu_check_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_lists_every_part_with_a_budget_within_the_total(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "tqdm-4.70.1-py3-none-any.whl").write_bytes(b"")
    r, parts = _dry_run(tmp_path, str(wheels))
    assert r.returncode == 0, r.stdout + r.stderr
    names = list(parts)
    assert names[:4] == [f"install wheels from {wheels}", "nvidia-smi",
                         "toolchain: python packages", "flashinfer toolchain"]
    assert "-m bench.gpu_check_env" in parts["toolchain: python packages"][1]
    pytest_parts = {n: c for n, (_, c) in parts.items() if "-m pytest" in c}
    assert [_pytest_files(c) for c in pytest_parts.values()] == [
        ["tests/test_shipping_path.py"], ["tests/test_graphs_cuda.py"], TRITON_FILES]
    for name, command in pytest_parts.items():
        per_test = re.search(r"--(?:timeout|test-limit)=(\d+)", command)
        assert per_test and int(per_test[1]) < parts[name][0], name  # below the part's limit
        assert "--junitxml=" in command and "-o addopts=" in command
    profile = parts["graphs.profile (the shipping pair)"][1]
    assert "--attention auto" in profile and "pair/target" in profile
    assert "-m bench.gpu_check_model" in parts["write the shipping pair"][1]
    layer = parts["real-size layer: Kimi K2.5 tp-8 shard, 4,096 tokens over 32,768 cached"][1]
    assert "-m bench.gpu_layer" in layer
    assert all(f in layer.split() for f in ("--tp", "8", "--prefix", "32768", "--chunk", "4096"))
    assert names[-3:] == [next(n for n in names if n.startswith("real-size layer")),
                          "write the shipping pair", "graphs.profile (the shipping pair)"]
    total = sum(b for b, _ in parts.values())
    assert total <= PARTS_TOTAL < TOTAL
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "DRY RUN" in summary and f"parts' budgets: {total}s of {TOTAL}s" in summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["summary.txt"]
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path / "out"),
                        str(tmp_path / "none")], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "no .whl files" in (tmp_path / "out" / "summary.txt").read_text()


def test_the_checks_test_files_collect_on_the_cpu(tmp_path):
    """Every test file a part runs collects here, and selects CUDA tests (a part with none
    would report NO TESTS SELECTED)."""
    _, parts = _dry_run(tmp_path)
    files = [f for _, c in parts.values() for f in _pytest_files(c)]
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda",
                        "-p", "no:cacheprovider", "-o", "addopts=", *files], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for f in files:
        assert f"{f}::" in r.stdout, f


SLOW_TESTS = """
import time

def test_quick():
    pass

def test_hangs():
    time.sleep(600)

def test_after():
    pass
"""


def test_a_test_over_the_per_test_limit_fails_alone(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW_TESTS)
    junit = tmp_path / "j.xml"
    # the hanging test sleeps 600 s: only the per-test limit ends the run before the timeout
    r = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_slow.py"),
                        "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}",
                        "-p", "bench.pytest_limit", "--test-limit=1"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert set(cases) == {"test_quick", "test_hangs", "test_after"}
    failure = cases["test_hangs"].find("failure")
    assert failure is not None and "per-test limit of 1 s" in failure.get("message")
    assert cases["test_after"].find("failure") is None


def _fake_python(tmp_path: Path, pidfile: Path | None = None) -> Path:
    """A `python` for the script: pytest runs (for real) tmp_path/test_slow.py in place of the
    repository's test files, or, given `pidfile`, hangs as an exec'd sleep; the summary's JUnit
    reader (a script on stdin) runs for real; every other call fails at once (the toolchain's
    parts)."""
    fake = tmp_path / "python"
    if pidfile is None:
        run_pytest = ('  args=(); for a in "$@"; do case "$a" in tests/*) ;; *) args+=("$a");; '
                      f'esac; done\n  exec {sys.executable} -m pytest {tmp_path}/test_slow.py '
                      '"${args[@]:2}"\n')
    else:
        run_pytest = f'  echo $$ > "{pidfile}"; exec sleep 600\n'
    fake.write_text("#!/usr/bin/env bash\n"
                    'if [ "$1" = "-m" ] && [ "$2" = pytest ]; then\n' + run_pytest + "fi\n"
                    f'if [ "$1" = "-" ]; then exec {sys.executable} "$@"; fi\n'
                    "exit 1\n")
    fake.chmod(0o755)
    return fake


def test_a_part_at_its_limit_gets_sigint_and_keeps_its_junit(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW_TESTS)
    out = tmp_path / "out"
    env = _env(tmp_path, PYTHON=str(_fake_python(tmp_path)), SHIPPING_TIMEOUT="5",
               GRAPHS_TIMEOUT="1", TRITON_TIMEOUT="1", TEST_TIMEOUT="0", GRACE="5",
               MIN_PART="3", PROFILE="0", LAYER="0")
    # the part's pytest sleeps 600 s: only its 5 s limit ends the script before the timeout
    r = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                       timeout=300)
    summary = (out / "summary.txt").read_text()
    shipping = next(line for line in summary.splitlines() if "the shipping path" in line)
    assert "TIMEOUT after 5s" in shipping
    assert summary.count("SKIPPED (") == 2  # the other pytest parts: budgets under MIN_PART
    assert "shipping: " in summary  # its JUnit report, read into the summary
    with tarfile.open(out / "junit.tar.gz") as tar:
        xml = tar.extractfile("junit/shipping.xml").read()
    names = {c.get("name") for c in ET.fromstring(xml).iter("testcase")}
    assert "test_quick" in names and "KeyboardInterrupt" in (out / "pytest.log").read_text()
    bad = ("TIMEOUT after", "SKIPPED (", "FAILED (", "FAILED,")
    assert r.returncode == sum(any(b in line for b in bad) for line in summary.splitlines())
    assert len(list(out.iterdir())) <= 8


def _running(pid: int) -> bool:
    """A live process (a zombie waiting for its parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_signal_to_the_script_stops_its_part_and_writes_the_summary(tmp_path):
    out, pid = tmp_path / "out", tmp_path / "pid"
    env = _env(tmp_path, PYTHON=str(_fake_python(tmp_path, pid)), PROFILE="0", LAYER="0")
    p = subprocess.Popen(["bash", str(SCRIPT), str(out)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not pid.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pid.exists(), "pytest never started"
        assert "RUNNING" in (out / "summary.txt").read_text()  # written before each part
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=15)  # at once, not after the part's limit
    finally:
        if p.poll() is None:
            p.kill()
    summary = (out / "summary.txt").read_text()
    assert "the shipping path" in summary and "INTERRUPTED" in summary
    assert p.returncode >= 1
    hung = int(pid.read_text())
    deadline = time.monotonic() + 10
    while _running(hung) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(hung)


def test_the_toolchain_names_each_missing_package(monkeypatch, capsys):
    assert set(gpu_check_env.requirements()) >= {"torch", "safetensors", "tiktoken", "numpy",
                                                   "tqdm", "pydantic", "jinja2"}
    monkeypatch.setitem(sys.modules, "tqdm", None)  # importing it now fails
    missing, _ = gpu_check_env.check_packages(["tqdm", "no-such-dist", "torch"])
    assert missing == ["tqdm", "no-such-dist"]
    printed = capsys.readouterr().out
    assert "tqdm               MISSING" in printed and "no-such-dist       MISSING" in printed
    assert "flashinfer-python  " in printed and "import engine.llm: " in printed
    # a dependency's own dependency is what to carry; module names map back to wheels
    assert gpu_check_env.wheel_of(ModuleNotFoundError("x", name="pydantic_core"),
                                  "pydantic") == "pydantic-core"
    assert gpu_check_env.wheel_of(ModuleNotFoundError("x", name="pynvml"), "?") == "nvidia-ml-py"
    assert gpu_check_env.wheel_of(OSError("libcuda.so"), "triton") == "triton"


def test_docs_list_every_wheel_to_carry():
    docs = (REPO / "docs" / "gpu.md").read_text()
    for dist in [*gpu_check_env.requirements(), *gpu_check_env.CHECK_NEEDS]:
        if dist not in ("torch", "triton"):  # on the machine's image
            assert f"`{dist}`" in docs, dist


def _fake_flashinfer(broken: str | None) -> types.ModuleType:
    fi = types.ModuleType("flashinfer")
    if broken is None:
        fi.merge_state, fi.sampling = object(), types.ModuleType("flashinfer.sampling")
    else:
        def fail(name: str):
            raise OSError(broken)

        fi.__getattr__ = fail
    return fi


def test_flashinfer_that_imports_only_in_part_is_not_taken(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert "does not import (ModuleNotFoundError" in attention_gpu.flashinfer_unavailable()
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer("libnvrtc.so.13: no file"))
    why = attention_gpu.flashinfer_unavailable()
    assert why is not None and "OSError: libnvrtc.so.13" in why
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = mla.MLAPlanMetadata = object
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(None))
    monkeypatch.setitem(sys.modules, "flashinfer.mla", None)  # no MLA module: not taken
    assert "flashinfer.mla" in attention_gpu.flashinfer_unavailable()
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    assert attention_gpu.flashinfer_unavailable() is None


def test_the_profile_of_the_shipping_pair_attends_as_asked(tmp_path):
    """The profile part's command on the CPU: `--attention` picks the backend (triton: the
    paged kernels' twins) and the results name it."""
    from bench.gpu_check_model import write_pair
    from graphs import profile

    target, draft = write_pair(tmp_path / "pair")
    threads = torch.get_num_threads()
    for want, name in (("triton", "paged"), ("torch", "torch")):
        out = tmp_path / f"{want}.json"
        try:
            rc = profile.main(["--model", str(target), "--draft", str(draft), "--attention",
                               want, "--batch-sizes", "2", "--budget", "3", "--steps", "1",
                               "--warmup", "0", "--prompt-len", "5", "--no-progress",
                               "--output", str(out)])
        finally:
            torch.set_num_threads(threads)
        assert rc == 0 and json.loads(out.read_text())["attention"] == name
