"""Prometheus metrics of a drafter: steps, drafts, resyncs, step time, open streams."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specdec.v1 import specdec_pb2

logger = logging.getLogger(__name__)

_STEP_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.0)


class DrafterMetrics:
    def __init__(self, method: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["method"]
        self.method = method
        self.steps = Counter("specdec:drafter_steps", "Propose messages answered.", labels,
                             registry=self.registry).labels(method)
        self.sequences = Counter("specdec:drafter_sequence_updates",
                                 "Sequence updates applied.", labels,
                                 registry=self.registry).labels(method)
        self.draft_tokens = Counter("specdec:drafter_draft_tokens", "Draft tokens proposed.",
                                    labels, registry=self.registry).labels(method)
        self.resyncs = Counter("specdec:drafter_resyncs",
                               "Sequences answered needs_resync (state lost or out of step).",
                               labels, registry=self.registry).labels(method)
        self.step_seconds = Histogram("specdec:drafter_step_seconds",
                                      "Time to apply one step's updates and draft.", labels,
                                      buckets=_STEP_BUCKETS, registry=self.registry).labels(method)
        self.open_streams = Gauge("specdec:drafter_open_streams",
                                  "Propose streams open (one per verifier).", labels,
                                  registry=self.registry).labels(method)
        self.port: int | None = None

    def observe_step(self, request: specdec_pb2.ProposeRequest,
                     response: specdec_pb2.ProposeResponse, seconds: float) -> None:
        self.steps.inc()
        self.sequences.inc(len(request.sequences))
        self.step_seconds.observe(seconds)
        for draft in response.drafts:
            if draft.needs_resync:
                self.resyncs.inc()
            else:
                self.draft_tokens.inc(len(draft.draft_token_ids))

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics from a daemon thread; returns the bound port (0: a free one)."""
        http_server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = http_server.server_address[1]
        logger.info("drafter metrics on http://%s:%d/metrics", host, self.port)
        return self.port
