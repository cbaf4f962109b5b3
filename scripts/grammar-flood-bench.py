"""A plain request's latency while a flood of expensive schemas compiles (docs/performance.md).

    python -m specdec serve --model ... --port 8000 &
    python scripts/grammar-flood-bench.py --base-url http://127.0.0.1:8000 --model NAME
    python scripts/grammar-flood-bench.py --base-url http://127.0.0.1:8000 --model NAME \\
        --abandon 50

By default sends plain chat requests one at a time, in `--rounds` pairs of phases: alone,
then while `--flood` clients keep sending JSON Schemas with `--patterns` patternProperties
each (distinct, so none is a cache hit: each compiles until the server's
--grammar-compile-timeout-s refuses it). Prints the median and worst plain latency of each
phase and their ratio.

With `--abandon N`: plain requests alone, then N such schemas sent at once and each
abandoned after `--abandon-after-s` (the client leaves; the server should stop compiling
it), then plain requests at once after the burst: the p50 and p99 of each phase, and how
the abandoned requests ended.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

import httpx


def expensive_schema(serial: int, num_patterns: int) -> dict:
    return {"type": "object", "additionalProperties": False, "title": f"flood-{serial}",
            "patternProperties": {f"^x{i}_[a-z]*$": {"type": "integer"}
                                  for i in range(num_patterns)}}


def expensive_request(model: str, serial: int, num_patterns: int) -> dict:
    return {"model": model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "JSON please."}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "flood", "schema": expensive_schema(serial, num_patterns)}}}


async def plain_latencies(client: httpx.AsyncClient, model: str, num: int) -> list[float]:
    latencies = []
    for index in range(num):
        started = time.perf_counter()
        response = await client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": f"Say hello number {index}."}]})
        response.raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


async def flood(client: httpx.AsyncClient, model: str, num_patterns: int,
                serials: itertools.count, counts: dict[int, int]) -> None:
    while True:
        response = await client.post("/v1/chat/completions",
                                     json=expensive_request(model, next(serials), num_patterns))
        counts[response.status_code] = counts.get(response.status_code, 0) + 1


async def abandoned(client: httpx.AsyncClient, model: str, serial: int, num_patterns: int,
                    after_s: float) -> str:
    """One expensive request the client gives up on after `after_s`; how it ended."""
    try:
        response = await client.post("/v1/chat/completions",
                                     json=expensive_request(model, serial, num_patterns),
                                     timeout=after_s)
    except httpx.TimeoutException:
        return "abandoned"
    return str(response.status_code)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(name: str, latencies: list[float]) -> float:
    median = statistics.median(latencies)
    print(f"{name}: p50 {median * 1e3:.0f} ms, p99 {percentile(latencies, 99) * 1e3:.0f} ms, "
          f"worst {max(latencies) * 1e3:.0f} ms ({len(latencies)} requests)")
    return median


async def sustained_flood(args: argparse.Namespace) -> None:
    alone: list[float] = []
    under: list[float] = []
    counts: dict[int, int] = {}
    serials = itertools.count()
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:
        await plain_latencies(client, args.model, 2)  # warm
        # Alternated, so that the machine's other load drifts into both phases alike.
        for _ in range(args.rounds):
            alone += await plain_latencies(client, args.model, args.num)
            flooders = [asyncio.create_task(flood(client, args.model, args.patterns, serials,
                                                  counts)) for _ in range(args.flood)]
            await asyncio.sleep(1.0)  # the flood's checks are running
            under += await plain_latencies(client, args.model, args.num)
            for task in flooders:
                task.cancel()
            await asyncio.gather(*flooders, return_exceptions=True)
    median_alone = summary("plain alone", alone)
    median_under = summary(f"plain during a flood of {args.flood}", under)
    print(f"flood answers by status: {dict(sorted(counts.items()))}")
    print(f"plain latency under the flood: {median_under / median_alone:.2f}x alone (medians)")


async def abandoned_flood(args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=args.abandon + 8)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600, limits=limits) as client:
        await plain_latencies(client, args.model, 2)  # warm
        alone = await plain_latencies(client, args.model, args.num)
        burst = [asyncio.create_task(abandoned(client, args.model, serial, args.patterns,
                                               args.abandon_after_s))
                 for serial in range(args.abandon)]
        started = time.perf_counter()
        after = await plain_latencies(client, args.model, args.num)
        plain_s = time.perf_counter() - started
        endings = await asyncio.gather(*burst)
    counts = {ending: endings.count(ending) for ending in sorted(set(endings))}
    median_alone = summary("plain before", alone)
    median_after = summary(f"plain from the burst of {args.abandon} abandoned schemas on "
                           f"({plain_s:.1f} s)", after)
    print(f"abandoned requests: {counts}")
    print(f"plain p50 after the burst: {median_after / median_alone:.2f}x before; p99 "
          f"{percentile(after, 99) / percentile(alone, 99):.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--num", type=int, default=5, help="plain requests per phase")
    parser.add_argument("--rounds", type=int, default=6, help="alone / flood phase pairs")
    parser.add_argument("--flood", type=int, default=16, help="concurrent flooding clients")
    parser.add_argument("--patterns", type=int, default=400)
    parser.add_argument("--abandon", type=int, default=0,
                        help="expensive requests sent at once and abandoned (0: the sustained "
                             "flood instead)")
    parser.add_argument("--abandon-after-s", type=float, default=1.0)
    parsed = parser.parse_args()
    asyncio.run(abandoned_flood(parsed) if parsed.abandon else sustained_flood(parsed))
