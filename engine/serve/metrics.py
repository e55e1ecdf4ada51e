"""Prometheus metrics (`prometheus_client`), one registry per server: responses by endpoint and
status, counted as they leave, and the engine's counters, gauges and accepted-length histogram,
updated by the engine loop."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
disable_created_metrics()


class Metrics:
    def __init__(self, max_emit: int):
        r = self.registry = CollectorRegistry()
        c = lambda name, doc, *labels: Counter(name, doc, labels, registry=r)  # noqa: E731
        g = lambda name, doc: Gauge(name, doc, registry=r)  # noqa: E731
        self.responses = c("kimi_requests", "HTTP responses by endpoint and status code.",
                           "endpoint", "status")
        self.finished = c("kimi_requests_finished", "Requests finished, by reason.", "reason")
        self.prompt_tokens = c("kimi_prompt_tokens", "Prompt tokens of accepted requests.")
        self.generated = c("kimi_generation_tokens", "Generated tokens.")
        self.preemptions = c("kimi_preemptions", "Requests preempted for KV pages.")
        self.steps = c("kimi_engine_steps", "Scheduler steps.")
        self.step_seconds = c("kimi_engine_step_seconds", "Wall time in scheduler steps.")
        self.phase_seconds = c("kimi_step_phase_seconds", "Wall time per step phase.", "phase")
        self.accepted = Histogram("kimi_accepted_tokens_per_step", "Tokens emitted per request "
                                  "per step (accepted drafts + 1).",
                                  buckets=range(1, max_emit + 1), registry=r)
        self.queue_depth = g("kimi_queue_depth", "Requests waiting for a batch slot.")
        self.running = g("kimi_running_requests", "Requests in the running batch.")
        self.kv_pages_free = g("kimi_kv_pages_free", "Free KV cache pages.")
        self.kv_pages_total = g("kimi_kv_pages_total", "Usable KV cache pages.")


class CountResponses:
    """Counts every response by endpoint and status, error responses included: a plain ASGI
    wrapper (prometheus_client has no such counter, and Starlette's BaseHTTPMiddleware would
    interpose on streams and delay disconnect detection)."""

    def __init__(self, app: ASGIApp, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")

        async def counting_send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                self.counter.labels(path if path in ENDPOINTS else "other",
                                    str(msg["status"])).inc()
            await send(msg)

        await self.app(scope, receive, counting_send if scope["type"] == "http" else send)
