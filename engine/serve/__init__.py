"""`python -m engine.serve`: an OpenAI-compatible server (`torchrun --nproc-per-node N -m
engine.serve --tp N ...` under tensor parallelism; rank 0 serves). `protocol` declares the
bodies, `worker` runs the engine loop and links it to the routes, `procs` puts the engine and
the HTTP side in processes of their own, `app` has the routes and streaming, `metrics`
Prometheus."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import EngineConfig, add_cli_args, parse_cli
from engine.serve.options import ServeConfig

log = logging.getLogger("engine.serve")


def main(argv: list[str] | None = None) -> None:
    import torch

    p = argparse.ArgumentParser(prog="python -m engine.serve",
                                description="OpenAI-compatible server with speculative decoding")
    add_cli_args(p, EngineConfig)
    add_cli_args(p, ServeConfig)
    _, engine, cfg = parse_cli(p, argv, EngineConfig, ServeConfig)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from engine.dist import leads

    threads = torch.get_num_threads()
    if leads(engine.tp):
        from engine.serve.procs import serve

        return serve(engine, cfg, threads)
    # tensor-parallel ranks > 0 run rank 0's model calls until it stops
    from engine.dist import PeerLost
    from engine.heap import freeze_heap
    from engine.llm import LLM, compile_auto

    llm = LLM(config=compile_auto(engine, False), warm_up=False)
    freeze_heap()
    try:
        llm.close()
    except PeerLost as e:
        sys.exit(f"error: {e}")
