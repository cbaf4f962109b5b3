"""vLLM's request latency histograms, shared by the gateway's and the verifier's metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)


class RequestLatency:
    """TTFT, TPOT and end-to-end latency, labelled with the model name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.model_name = model_name
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", labels,
            buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request, in seconds.", labels,
            buckets=TOKEN_LATENCY_BUCKETS, registry=registry)

    def observe(self, started_at: float, first_token_at: float | None, finished_at: float,
                num_output_tokens: int) -> None:
        model = self.model_name
        self.e2e_latency.labels(model).observe(finished_at - started_at)
        if first_token_at is None:
            return
        self.time_to_first_token.labels(model).observe(first_token_at - started_at)
        if num_output_tokens > 1:
            self.time_per_output_token.labels(model).observe(
                (finished_at - first_token_at) / (num_output_tokens - 1))
