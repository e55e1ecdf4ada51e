"""Ranks forked from one server that imported torch and the engine once (`tests/test_parallel.py`):
each rank is a process of its own in torchrun's environment, as `python ARGV...` would run it,
without paying again for what every rank imports (about 2.5 s of CPU a process; a 4-rank run
on two cores spent most of its time there). The CLIs' own runs under torchrun stay real
processes (`torchrun` in the tests)."""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch  # noqa: F401 - what every rank imports, imported once in the server

import engine.generate  # noqa: F401
import tests.tp_run  # noqa: F401


def _run(env: dict[str, str], argv: list[str], err: str) -> None:
    """In the forked rank: `env` over the server's environment, stdout to nowhere and stderr
    to the file `err`, then `argv` as `python argv...` runs it (`-m MODULE ...` or a script)."""
    os.environ.update(env)
    for fd, path, flags in ((1, os.devnull, os.O_WRONLY),
                            (2, err, os.O_WRONLY | os.O_APPEND)):
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


class Rank:
    """A forked rank with the parts of `subprocess.Popen` the tests use."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self.proc = proc

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.proc.pid), timeout or 0)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()


def launch(n: int, argv: list[str], tmp: Path, port: int) -> list[tuple[Rank, Path]]:
    """`n` ranks of `python argv...` in torchrun's environment (the rendezvous on `port`), each
    one's stderr in `tmp/rank{r}.err` (it exists on return, empty until the rank writes)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.forked"])
    ranks = []
    for r in range(n):
        env = {"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        err = tmp / f"rank{r}.err"
        err.touch()  # before the rank runs, so a caller may read it at once
        p = ctx.Process(target=_run, args=(env, argv, str(err)), daemon=True)
        p.start()
        ranks.append((Rank(p), err))
    return ranks
