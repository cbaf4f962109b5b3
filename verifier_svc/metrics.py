"""Prometheus metrics of the verifier, with vLLM's names where they exist.

Counters and gauges are read from the engine when Prometheus scrapes (a custom
collector), so the engine's hot path pays nothing for them; only the latency
histograms are observed as requests finish and drafts return.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specdec.latency_metrics import RequestLatency
from verifier_svc.speculation.policy import POLICY_STATES

if TYPE_CHECKING:
    from specdec.engine.scheduler import Scheduler
    from specdec.engine.sequence import Sequence, SpeculationCounters
    from verifier_svc.drafting.drafter_pool import DrafterPool

logger = logging.getLogger(__name__)

class EngineState(Protocol):
    """What the collector reads of the engine at scrape time (the engine satisfies it; this
    module does not import the engine, which holds a VerifierMetrics)."""

    spec: SpeculationCounters
    scheduler: Scheduler
    drafter_pool: DrafterPool | None

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


_RPC_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


class _EngineCollector(Collector):
    def __init__(self, engine: EngineState, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        engine, labels = self.engine, [self.model_name]
        spec = engine.spec
        for name, documentation, count in (
                ("vllm:spec_decode_num_drafts", "Verify steps that checked draft tokens.",
                 spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                 spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 spec.num_accepted_tokens),
                ("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.",
                 engine.scheduler.num_preemptions),
                ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens (the tokens "
                 "of each sequence admitted while prefix caching is on).",
                 engine.scheduler.block_manager.num_queried_tokens),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.",
                 engine.scheduler.block_manager.num_hit_tokens),
                ("specdec:prefix_cache_evicted_blocks", "Cached KV blocks reused for new "
                 "tokens (evicted from the prefix cache).",
                 engine.scheduler.block_manager.num_evicted_blocks)):
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric(labels, count)
            yield counter
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted.",
            labels=["model_name", "position"])
        for position, value in enumerate(spec.accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position
        block_manager = engine.scheduler.block_manager
        pool = engine.drafter_pool
        for name, documentation, level in (
                ("vllm:num_requests_running", "Sequences in the running batch.", engine.num_running),
                ("vllm:num_requests_waiting", "Sequences waiting to run.", engine.num_waiting),
                ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).",
                 block_manager.usage),
                ("specdec:kv_cache_free_blocks", "KV blocks free in the pool.",
                 block_manager.num_free_blocks),
                ("specdec:kv_cache_blocks", "KV blocks in the pool.", block_manager.num_blocks),
                ("specdec:prefix_cache_blocks", "Blocks holding cached prefixes (held or "
                 "free to reuse).", block_manager.num_cached_blocks),
                ("specdec:drafter_healthy_replicas", "Drafter replicas connected and healthy.",
                 pool.num_healthy() if pool is not None else 0)):
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric(labels, level)
            yield gauge
        yield self._policy_states(engine)
        drafter_errors = CounterMetricFamily(
            "specdec:drafter_errors",
            "Drafter failures by replica (address) and kind: timeout, unavailable, "
            "stream_error, bad_response, refused.",
            labels=["model_name", "replica", "kind"])
        if pool is not None:  # a copy: this runs on the metrics server's thread
            for (replica, kind), value in sorted(pool.errors.counts.copy().items()):
                drafter_errors.add_metric([self.model_name, replica, kind], value)
        yield drafter_errors


    def _policy_states(self, engine: EngineState) -> GaugeMetricFamily:
        """Running sequences by the adaptive policy's state for them (every state listed,
        0 included, so that a dashboard's series do not vanish)."""
        family = GaugeMetricFamily(
            "specdec:speculation_policy_sequences",
            "Running sequences by the adaptive speculation policy's last decision: drafting, "
            "probing (off, one draft token to measure acceptance again) or off (each "
            "response's usage.speculation.policy says why).",
            labels=["model_name", "state"])
        counts = dict.fromkeys(POLICY_STATES, 0)
        # A copy: this runs on the metrics server's thread while the engine steps.
        for seq in list(engine.scheduler.running):
            state = seq.spec.policy_state
            if state in counts:
                counts[state] += 1
        for state, count in counts.items():
            family.add_metric([self.model_name, state], count)
        return family


class VerifierMetrics:
    """The verifier's registry; `serve(port)` exposes it over HTTP at /metrics."""

    def __init__(self, engine: EngineState, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.port: int | None = None
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.latency = RequestLatency(self.registry, model_name)
        self.drafter_round_trip = Histogram(
            "specdec:drafter_round_trip_seconds",
            "Time from sending a step's proposals request to having its drafts (or the "
            "deadline).", labels, buckets=_RPC_BUCKETS, registry=self.registry)

    def observe_finished(self, seq: Sequence, now: float) -> None:
        self.latency.observe(seq.arrival_time, seq.first_token_time, now, seq.num_output_tokens)

    def observe_round_trip(self, seconds: float) -> None:
        self.drafter_round_trip.labels(self.model_name).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics from a daemon thread; returns the bound port (port 0: a free one)."""
        http_server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self.port = http_server.server_address[1]
        logger.info("verifier metrics on http://%s:%d/metrics", host, bound)
        return bound
