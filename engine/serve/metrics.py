"""Prometheus metrics (`prometheus_client`), one registry per server: the engine's counters,
gauges and accepted-length histogram, updated by the engine loop; `instrument` adds responses by
handler and status (`prometheus_fastapi_instrumentator`) and serves `GET /metrics`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

if TYPE_CHECKING:  # the engine's process imports this module and serves no HTTP
    from fastapi import FastAPI

disable_created_metrics()


class Metrics:
    def __init__(self, max_emit: int):
        r = self.registry = CollectorRegistry()
        c = lambda name, doc, *labels: Counter(name, doc, labels, registry=r)  # noqa: E731
        self.finished = c("kimi_requests_finished", "Requests finished, by reason.", "reason")
        self.prompt_tokens = c("kimi_prompt_tokens", "Prompt tokens of accepted requests.")
        self.generated = c("kimi_generation_tokens", "Generated tokens.")
        self.preemptions = c("kimi_preemptions", "Requests preempted for KV pages.")
        self.prefix_queries = c("kimi_prefix_cache_queries", "Prompt tokens looked up in the "
                                "prefix cache (at each request's first admission).")
        self.prefix_hits = c("kimi_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                             "(not prefilled again).")
        self.evicted = c("kimi_prefix_cache_evicted_pages", "Cached KV pages evicted for room.")
        self.steps = c("kimi_engine_steps", "Scheduler steps.")
        self.step_seconds = c("kimi_engine_step_seconds", "Wall time in scheduler steps.")
        self.phase_seconds = c("kimi_step_phase_seconds", "Wall time per step phase.", "phase")
        self.accepted = Histogram("kimi_accepted_tokens_per_step", "Tokens emitted per request "
                                  "per step (accepted drafts + 1).",
                                  buckets=range(1, max_emit + 1), registry=r)
        self.queue_depth = Gauge("kimi_queue_depth", "Requests waiting for a batch.", registry=r)
        self.running = Gauge("kimi_running_requests", "Requests in the running batch.", registry=r)
        self.kv_pages_free = Gauge("kimi_kv_pages_free", "Free KV cache pages.", registry=r)
        self.kv_pages_total = Gauge("kimi_kv_pages_total", "Usable KV cache pages.", registry=r)
        self.kv_pages_cached = Gauge("kimi_kv_pages_cached", "KV pages the prefix cache holds.",
                                     registry=r)

    def instrument(self, app: FastAPI) -> None:
        from prometheus_fastapi_instrumentator import Instrumentator
        from prometheus_fastapi_instrumentator import metrics as http

        Instrumentator(should_group_status_codes=False, registry=self.registry).add(
            http.requests(metric_name="kimi_requests", should_include_method=False,
                          registry=self.registry)).instrument(app).expose(app)
