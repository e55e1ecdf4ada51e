"""The server's own options (`ServeConfig`): the CLI flags `python -m engine.serve` adds to the
engine's, read by the app and by `uvicorn`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    host: str = Field("127.0.0.1", description="address to listen on")
    port: Annotated[int, Field(ge=0, le=65535)] = Field(8000, description="port to listen on")
    max_queue: Annotated[int, Field(ge=1)] = Field(
        256, description="requests allowed to wait for a batch slot before 503")
    served_model_name: str | None = Field(
        None, description="the model id clients send (default: the model directory's name)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="how much to log")
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/*, "
                          "/tokenize and /detokenize (default: $KIMI_API_KEY; neither: no key; "
                          "/health and /metrics stay open)")
    allowed_hosts: str | None = Field(
        None, description="comma-separated Host header names accepted, '*' any (default: when "
                          "--host is a loopback address, localhost, 127.0.0.1, ::1 and --host; "
                          "else any)")
    request_timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        30.0, description="seconds a request's headers, and then its body, may take to arrive "
                          "before 408")
    timeout_keep_alive: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        5.0, description="seconds an idle keep-alive connection stays open (uvicorn's)")
    limit_concurrency: Annotated[int, Field(ge=1)] = Field(
        1024, description="connections (or requests) at once before 503 (uvicorn's)")
    allow_image_urls: bool = Field(
        False, description="fetch http(s) image URLs of image parts (default: data: URLs only; "
                           "the server then reaches any address a client names)")
    image_fetch_timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)] = Field(
        10.0, description="seconds a fetched image's connection and each read may take")
    limit_mm_per_prompt: Annotated[int, Field(ge=0)] | None = Field(
        None, description="images one prompt may hold, at most (default: no limit; 0: none)")
    max_body_bytes: Annotated[int, Field(ge=1024)] = Field(
        16 << 20, description="largest request body accepted before 413")
    reserve_cpus: Annotated[int, Field(ge=0)] = Field(
        1, description="CPU cores left to the HTTP process when the engine runs on the CPU "
                       "(torch's threads take the rest, at least one; 0: every core, the most "
                       "tokens/s when few answers stream)")

