"""`python -m engine.serve` in two processes, as vLLM V1 runs: the engine core in this process
(the model, the scheduler, the step loop; the tensor-parallel leader under torchrun) and the
HTTP frontend in a child process (uvicorn, the routes, templating, the answers' parsing and
streaming), linked by two pipes: commands down, one report per step up
(`engine.serve.worker.Core` and `Remote`). So serving many streams costs the step loop no
interpreter lock, only the pickling of one report a step.

Start-up: the frontend is spawned first, so its imports overlap the model's loading; it listens
once the core sends `Ready` (the model's limits, after its step graphs are captured).
Shutdown: a signal to the core (Ctrl-C, SIGTERM) goes on to the frontend, which stops
listening, gives the answers still open SHUTDOWN_GRACE_S to finish, ends the others (their
request aborted, a stream's last chunk with finish reason `abort`, then `data: [DONE]`), closes
its connections and then tells the core to stop: a few seconds in all, and exit status 0. The
core also stops when the frontend's pipe closes however it ended, and the frontend when the
core's does. The frontend has a process group of its own, so a terminal's Ctrl-C reaches only
the core. A port already taken fails at once, before the model loads: the core binds it once
to see, and the frontend holds it from its start (`listen_socket`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.heap import freeze_heap
from engine.request import Limits
from engine.serve.options import ServeConfig

log = logging.getLogger("engine.serve")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
# Seconds the answers open at a shutdown get to finish before they are ended (aborted).
SHUTDOWN_GRACE_S = 2.0


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` as uvicorn binds one (SO_REUSEADDR: a port left in
    TIME_WAIT is free, one a server listens on is not); OSError when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def port_problem(host: str, port: int) -> str | None:
    """Why `python -m engine.serve` cannot listen on `host`:`port`, or None when it can."""
    try:
        listen_socket(host, port).close()
    except OSError as e:
        return (f"cannot listen on {host}:{port}: {e.strerror or e} (another server there? "
                f"choose another --port or --host)")
    return None


@dataclass
class Ready:
    """What the frontend needs of the loaded model before it listens."""

    name: str
    limits: Limits
    snapshot: dict[str, int]
    # The id an image's tokens expand from, when the model takes images (None: text only).
    # NOTE: from the engine's loaded model, so the frontend never imports the tower (torch).
    image_pad: int | None = None


def frontend(cfg: ServeConfig, model_dir: Path, commands: Connection, reports: Connection
             ) -> None:
    """The child process: loads `model_dir`'s tokenizer, waits for `Ready`, then serves HTTP
    until a signal or the core's end."""
    os.setpgrp()
    logging.basicConfig(level=cfg.log_level.upper(), format=LOG_FORMAT)
    try:  # held from the start: a port taken while the model loads fails here, not later
        sock = listen_socket(cfg.host, cfg.port)
    except OSError as e:
        log.error("%s", port_problem(cfg.host, cfg.port) or e)
        sys.exit(1)
    import uvicorn

    from engine.grammar import Grammars
    from engine.media import MediaConfig
    from engine.serve.app import build_app, uvicorn_options
    from engine.serve.worker import Engine, ModelInfo, Remote
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.of_model(model_dir)
    try:
        ready = reports.recv()
    except EOFError:
        return
    if not isinstance(ready, Ready):  # the core could not start (it says why)
        return
    lim = ready.limits
    model = ModelInfo(tok, lim.max_model_len, lim.vocab_size,
                      Grammars(tok, lim.vocab_size) if tok else None, ready.image_pad,
                      MediaConfig.from_dir(model_dir))
    engine = Engine(link=Remote(commands, reports, lim, ready.snapshot))
    app = build_app(None, ready.name, cfg.max_queue, config=cfg, model=model, engine=engine)
    log.info("serving %r on http://%s:%d (max_model_len %d, %d KV pages)", ready.name, cfg.host,
             cfg.port, lim.max_model_len, lim.capacity)
    # NOTE: the answers still open are ended after SHUTDOWN_GRACE_S; uvicorn's own bound (it
    # then cancels what is left, with a traceback) is only a backstop.
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 3,
                            **uvicorn_options(cfg))

    class Server(uvicorn.Server):
        """uvicorn's, whose shutdown ends the answers still open after SHUTDOWN_GRACE_S."""

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            def end() -> None:
                if n := engine.end_open():
                    log.info("ended %d answer(s) still open %.0f s into the shutdown", n,
                             SHUTDOWN_GRACE_S)

            timer = asyncio.get_running_loop().call_later(SHUTDOWN_GRACE_S, end)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    freeze_heap()  # start-up is done: later collections scan only what serving makes
    Server(config).run(sockets=[sock])


def serve(engine_cfg: EngineConfig, cfg: ServeConfig, threads: int) -> None:
    """The core's side: spawns the frontend, loads the model, serves it until the frontend
    ends; exits non-zero when the engine stopped for good or the frontend failed (a port
    already taken fails before anything loads)."""
    if problem := port_problem(cfg.host, cfg.port):
        sys.exit(f"error: {problem}")
    import torch

    from engine.dist import PeerLost
    from engine.llm import LLM, compile_auto, model_pair
    from engine.serve.worker import Core, ModelInfo, unwire

    ctx = mp.get_context("spawn")
    cmd_out, cmd_in = ctx.Pipe(duplex=False)  # (receiving end, sending end)
    rep_out, rep_in = ctx.Pipe(duplex=False)
    front = ctx.Process(target=frontend, name="engine.serve-http",
                        args=(cfg, model_pair(engine_cfg.model, None)[0], cmd_in, rep_out))
    front.start()
    cmd_in.close()
    rep_out.close()

    def end(why: str | None) -> None:
        with contextlib.suppress(OSError):
            rep_in.send(("end", why))

    try:
        threads = engine_threads(engine_cfg, cfg, threads)
        # A server answers within seconds of its start: `--compile auto` leaves its steps
        # eager, and `--compile on` compiles them before it listens (from a cold cache, long).
        torch.set_num_threads(threads)
        llm = LLM(config=compile_auto(engine_cfg, False), warm_up=False)
        llm.runner.capture(lagging=True)
        freeze_heap()
    except BaseException:
        end("the engine did not start")
        _reap(front)
        raise
    core = Core(llm, rep_in.send)
    signals = {"n": 0}

    def on_signal(signum: int, _: Any) -> None:
        signals["n"] += 1
        if signals["n"] == 1 and front.is_alive():
            front.terminate()  # it closes its connections, then stops the core
        else:
            core.post(("stop", None))

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)

    def commands() -> None:
        while True:
            try:
                cmd = cmd_out.recv()
            except (EOFError, OSError):  # the frontend is gone
                cmd = ("stop", None)
            if cmd[0] == "add":
                cmd = ("add", unwire(cmd[1]))
            core.post(cmd)
            if cmd[0] == "stop":
                return

    name = cfg.served_model_name or llm.model_dir.resolve().name
    rep_in.send(Ready(name, llm.scheduler.limits, core.snapshot,
                      ModelInfo.of(llm).image_pad))
    threading.Thread(target=commands, name="engine-commands", daemon=True).start()
    try:
        core.run()
    finally:
        end(core.fatal)
        _reap(front)
        try:
            llm.close()
        except PeerLost as e:
            core.fatal = core.fatal or str(e)
    if core.fatal:
        sys.exit(f"error: stopped: {core.fatal}")
    if front.exitcode not in (0, -signal.SIGTERM):  # uvicorn raises the signal it ended on
        sys.exit(f"error: the HTTP server exited with status {front.exitcode}")
    # NOTE: the frontend is reaped and the engine closed, so nothing is left to clean up; the
    # interpreter's teardown of torch's native state would add seconds to a stop.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def engine_threads(engine_cfg: EngineConfig, cfg: ServeConfig, threads: int) -> int:
    """The engine's torch threads: on the CPU, `threads` less what leaves `--reserve-cpus` of
    the process's cores to the HTTP process, at least one (as vLLM's CPU backend reserves a
    core for its own processes). A parallel step waits for its slowest thread: HTTP work on a
    core the step's threads use stalls the whole step."""
    from engine.llm import resolve_device

    if resolve_device(engine_cfg)[0].type != "cpu" or not cfg.reserve_cpus:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    n = max(1, min(threads, cores - cfg.reserve_cpus))
    log.info("engine: %d torch thread(s); %d of %d cores left to the HTTP process "
             "(--reserve-cpus)", n, cores - n, cores)
    return n


def _reap(front: Any) -> None:
    """Waits for the frontend to end (its graceful shutdown takes at most 5 s), then ends it."""
    front.join(15)
    if front.is_alive():
        front.kill()
        front.join(5)
