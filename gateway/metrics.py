"""Prometheus metrics of one gateway app, on its own registry, with vLLM's names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.generation import GenerationResult
from specdec.latency_metrics import RequestLatency

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model_name = model_name
        labels = ["model_name"]
        self.http_requests = Counter(
            "specdec:gateway_http_requests", "HTTP requests to the /v1 API by status code.",
            ["endpoint", "status"], registry=self.registry)
        self.latency = RequestLatency(self.registry, model_name)
        self.num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Verify steps that checked draft tokens.", labels,
            registry=self.registry)
        self.num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels,
            registry=self.registry)
        self.num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
            registry=self.registry)

    def observe_generation(self, result: GenerationResult) -> None:
        model = self._model_name
        self.latency.observe(result.started_at, result.first_token_at,
                             result.finished_at or result.started_at,
                             result.num_completion_tokens)
        stats = result.speculation
        if stats is not None:
            self.num_drafts.labels(model).inc(stats.num_drafts)
            self.num_draft_tokens.labels(model).inc(stats.num_draft_tokens)
            self.num_accepted_tokens.labels(model).inc(stats.num_accepted_tokens)

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class RequestCountMiddleware:
    """Counts /v1 responses by status; reads metrics from app.state (set in the lifespan)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            metrics: GatewayMetrics | None = getattr(scope["app"].state, "metrics", None)
            if metrics is not None:
                metrics.http_requests.labels(endpoint, str(status)).inc()
