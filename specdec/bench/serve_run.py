"""`bench serve`'s run: requests sent to a server under a rate and a concurrency cap, each
timed on the client, and the server's speculation counters read before and after
(`run_benchmark`, the async API behind the command; tests drive load with it)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from specdec.bench.serve_report import SpecCounters, parse_speculation_metrics, responses_speculation
from specdec.bench.serve_requests import BenchRequest, RequestResult, describe_error, send_request
from specdec.cli import DEFAULT_GATEWAY_PORT

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = f"http://127.0.0.1:{DEFAULT_GATEWAY_PORT}"


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str = DEFAULT_BASE_URL
    model: str | None = None        # None: the first of GET /v1/models
    request_rate: float = math.inf  # requests/s, Poisson arrivals
    max_concurrency: int | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True
    # Where the speculation counters are read; None: the server's own /metrics. Point it at
    # the verifier's metrics port for its per-position counters, or for several gateways.
    metrics_url: str | None = None

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        object.__setattr__(self, "base_url", _normalise_base_url(self.base_url))


@dataclass(slots=True)
class BenchReport:
    config: BenchConfig
    model: str | None
    results: list[RequestResult]
    duration_s: float
    metrics_delta: SpecCounters | None  # None: /metrics unreadable or without the counters

    @property
    def failed(self) -> list[RequestResult]:
        return [r for r in self.results if not r.success]


# ------------------------------------------------------------------ the run

async def run_benchmark(config: BenchConfig, requests: list[BenchRequest],
                        on_result: Callable[[RequestResult], None] | None = None,
                        ) -> BenchReport:
    """Sends `requests` as configured; returns every result (failures included)."""
    async with open_client(config) as client:
        model = config.model or await fetch_model(client)
        metrics_url = config.metrics_url or "/metrics"
        before = await scrape_speculation(client, metrics_url)
        semaphore = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
        arrivals = random.Random(config.seed)
        progress = Progress(len(requests), config.progress)
        started = time.perf_counter()

        async def one(index: int, request: BenchRequest) -> RequestResult:
            async with semaphore:
                result = RequestResult(index, start_s=time.perf_counter() - started)
                await send_request(client, request, model, result)
            progress.update()
            if on_result is not None:
                on_result(result)
            return result

        tasks = []
        try:
            for index, request in enumerate(requests):
                if index and math.isfinite(config.request_rate):
                    await asyncio.sleep(arrivals.expovariate(config.request_rate))
                tasks.append(asyncio.create_task(one(index, request)))
            results = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            progress.close()
        duration_s = time.perf_counter() - started
        after = await _scrape_settled(client, metrics_url, results)
    delta = None
    if before is not None and after is not None and after.exported:
        delta = after.minus(before)
    return BenchReport(config, model, results, duration_s, delta)


def open_client(config: BenchConfig) -> httpx.AsyncClient:
    """The client of a run: the server, its key, the timeout, a connection per request in
    flight."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(base_url=config.base_url, headers=headers,
                             timeout=httpx.Timeout(config.timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=config.max_concurrency,
                                                 max_keepalive_connections=None))


async def fetch_model(client: httpx.AsyncClient) -> str | None:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except Exception as exc:
        logger.warning("cannot list models (%s); sending requests without a model name",
                       describe_error(exc))
        return None


async def scrape_speculation(client: httpx.AsyncClient, url: str = "/metrics",
                             ) -> SpecCounters | None:
    """The speculation counters on /metrics; None when /metrics cannot be read."""
    try:
        response = await client.get(url)
        response.raise_for_status()
        return parse_speculation_metrics(response.text)
    except Exception as exc:
        logger.debug("cannot read /metrics: %s", describe_error(exc))
        return None


async def _scrape_settled(client: httpx.AsyncClient, url: str,
                          results: list[RequestResult]) -> SpecCounters | None:
    """The gateway counts a streamed request when its stream closes, a moment after the
    client read [DONE]: re-read briefly until the counters cover what the responses saw."""
    expected = responses_speculation(results).num_drafts
    after = await scrape_speculation(client, url)
    for _ in range(10):
        if after is None or after.num_drafts >= expected:
            break
        await asyncio.sleep(0.05)
        after = await scrape_speculation(client, url)
    return after


class Progress:
    """tqdm when importable, else a plain counter on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._total, self._done, self._bar = total, 0, None
        self._enabled = enabled and total > 0
        if self._enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, unit="req", file=sys.stderr)
            except ImportError:
                pass

    def update(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self._enabled:
            end = "\n" if self._done == self._total else ""
            print(f"\r{self._done}/{self._total} requests", end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ------------------------------------------------------------------ the command


def _normalise_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url
