"""`python -m engine.serve`: an OpenAI-compatible server (`torchrun --nproc-per-node N -m
engine.serve --tp N ...` under tensor parallelism; rank 0 serves). `protocol` declares the
bodies, `worker` runs the engine loop, `app` the routes and streaming, `metrics` Prometheus."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import EngineConfig, add_cli_args, parse_cli
from engine.serve.options import ServeConfig

log = logging.getLogger("engine.serve")


def main(argv: list[str] | None = None) -> None:
    import torch
    import uvicorn

    from engine.dist import PeerLost
    from engine.llm import LLM, compile_auto
    from engine.serve.app import build_app, uvicorn_options

    p = argparse.ArgumentParser(prog="python -m engine.serve",
                                description="OpenAI-compatible server with speculative decoding")
    add_cli_args(p, EngineConfig)
    add_cli_args(p, ServeConfig)
    _, engine, cfg = parse_cli(p, argv, EngineConfig, ServeConfig)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # NOTE: torch's CPU thread team belongs to the thread that first runs parallel work; a second
    # team beside the main thread's makes each step several times slower on a small machine: the
    # main thread loads at one thread, the engine thread (warm-up, steps) gets the rest.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A server answers within seconds of its start: `--compile auto` leaves its steps eager, and
    # `--compile on` compiles them before it listens (from a cold cache, a long while).
    llm = LLM(config=compile_auto(engine, False), warm_up=False, threads=threads)
    if not llm.is_leader:  # tensor-parallel ranks > 0 run rank 0's model calls until it stops
        torch.set_num_threads(threads)
        try:
            return llm.close()
        except PeerLost as e:
            sys.exit(f"error: {e}")
    name = cfg.served_model_name or llm.model_dir.resolve().name
    app = build_app(llm, name, cfg.max_queue, threads, config=cfg)
    log.info("serving %r on http://%s:%d (max_model_len %d, %d KV pages)", name, cfg.host,
             cfg.port, llm.max_model_len, llm.scheduler.alloc.capacity)
    try:
        # A bounded graceful shutdown: open streams must not keep the process alive.
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                    timeout_graceful_shutdown=5, **uvicorn_options(cfg))
    finally:
        llm.close()
    if app.state.server.engine.fatal:
        sys.exit(f"error: stopped: {app.state.server.engine.fatal}")
