"""The figures of a serving benchmark: speculation counters, latency statistics, output.

Speculation comes from the gateway's /metrics (vLLM's counters, before and after the run)
or, when /metrics lacks them, from the responses' usage.speculation; per-position
acceptance (accepted at position i / drafts) likewise.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from specdec.bench.serve_requests import RequestResult

class RunSettings(Protocol):
    """What a summary reports of how a run was made (`bench serve`'s BenchConfig, frozen:
    hence read-only members)."""

    @property
    def base_url(self) -> str: ...

    @property
    def request_rate(self) -> float: ...

    @property
    def max_concurrency(self) -> int | None: ...


class BenchRun(Protocol):
    """A finished run as `summarise` reads it (`bench serve`'s BenchReport): this module
    sits below the command, so it names what it reads rather than importing it."""

    model: str | None
    results: list[RequestResult]
    duration_s: float
    metrics_delta: SpecCounters | None

    @property
    def config(self) -> RunSettings: ...


# Gateway counters (prometheus_client exports a Counter `x` as `x_total`).
_METRIC_FIELDS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(slots=True)
class SpecCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    # None: not exported (metrics) or not reported (responses).
    accepted_per_position: list[float] | None = None
    # False: /metrics has none of the counters (yet: a labelled counter appears when first
    # counted; or at all: another server).
    exported: bool = True

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens a draft yields with the one it always adds; None
        without drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def minus(self, before: SpecCounters) -> SpecCounters:
        per_position = None
        if self.accepted_per_position is not None:
            earlier = before.accepted_per_position or []
            per_position = [n - (earlier[i] if i < len(earlier) else 0.0)
                            for i, n in enumerate(self.accepted_per_position)]
        return SpecCounters(self.num_drafts - before.num_drafts,
                            self.num_draft_tokens - before.num_draft_tokens,
                            self.num_accepted_tokens - before.num_accepted_tokens, per_position,
                            self.exported)


def parse_speculation_metrics(text: str) -> SpecCounters:
    """The gateway's counters, summed over label sets (several models or gateways)."""
    counters = SpecCounters(exported=False)
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if sample.name.endswith("_created"):
                continue
            if name in _METRIC_FIELDS:
                counters.exported = True
                attribute = _METRIC_FIELDS[name]
                setattr(counters, attribute, getattr(counters, attribute) + sample.value)
            elif name == _PER_POSITION_METRIC and "position" in sample.labels:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    if per_position:
        counters.accepted_per_position = [per_position.get(i, 0.0)
                                          for i in range(max(per_position) + 1)]
    return counters


def responses_speculation(results: list[RequestResult]) -> SpecCounters:
    accepted_per_position: list[float] = []
    total = SpecCounters(accepted_per_position=accepted_per_position)
    for result in results:
        spec = result.speculation
        if not result.success or not spec:
            continue
        total.num_drafts += spec.get("num_drafts", 0)
        total.num_draft_tokens += spec.get("num_draft_tokens", 0)
        total.num_accepted_tokens += spec.get("num_accepted_tokens", 0)
        for position, count in enumerate(spec.get("accepted_per_position") or ()):
            if position == len(accepted_per_position):
                accepted_per_position.append(0.0)
            accepted_per_position[position] += count
    return total


# ------------------------------------------------------------------ figures

def summarise(report: BenchRun) -> dict[str, Any]:
    """Every figure the command prints, JSON-ready (None where there is no data)."""
    config, results = report.config, report.results
    ok = [r for r in results if r.success]
    duration = max(report.duration_s, 1e-9)
    total_output = sum(r.num_output_tokens for r in ok)
    total_input = sum(r.num_prompt_tokens for r in ok)
    streamed = [(r, r.ttft_s) for r in ok if r.ttft_s is not None]
    ttfts = [ttft_s * 1000 for _, ttft_s in streamed]
    tpots = [(r.e2e_s - ttft_s) * 1000 / (r.num_output_tokens - 1)
             for r, ttft_s in streamed if r.num_output_tokens > 1]
    itls = [gap * 1000 for r, _ in streamed for gap in r.itls_s]
    e2els = [r.e2e_s * 1000 for r in ok]
    summary: dict[str, Any] = {
        "base_url": config.base_url,
        "model": report.model,
        "num_prompts": len(results),
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "max_concurrency": config.max_concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": report.duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        summary[f"mean_{name}_ms"] = sum(values) / len(values) if values else None
        summary[f"median_{name}_ms"] = _percentile(values, 50)
        summary[f"p99_{name}_ms"] = _percentile(values, 99)
    from_responses = responses_speculation(results)
    metrics = report.metrics_delta
    summary["speculation"] = _speculation_block(metrics or from_responses,
                                                "metrics" if metrics else "responses",
                                                from_responses)
    summary["speculation_from_responses"] = _speculation_block(from_responses, "responses",
                                                               from_responses)
    summary["errors"] = error_counts(results)
    summary["requests"] = [
        {"success": r.success, "error": r.error or None, "start_s": r.start_s,
         "e2e_ms": r.e2e_s * 1000, "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1000,
         "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens}
        for r in results]
    return summary


def error_counts(results: list[RequestResult]) -> dict[str, int]:
    """The failed requests' errors with their counts, most frequent first."""
    return dict(Counter(r.error for r in results if not r.success).most_common())


def _speculation_block(counters: SpecCounters, source: str,
                       from_responses: SpecCounters) -> dict[str, Any]:
    drafts = counters.num_drafts
    per_position, per_position_source = counters.accepted_per_position, source
    if not per_position:  # not exported by /metrics: the responses carry it
        per_position, per_position_source = from_responses.accepted_per_position, "responses"
        drafts_for_positions = from_responses.num_drafts
    else:
        drafts_for_positions = drafts
    return {
        "source": source,
        "num_drafts": int(drafts),
        "num_draft_tokens": int(counters.num_draft_tokens),
        "num_accepted_tokens": int(counters.num_accepted_tokens),
        "acceptance_rate": (counters.num_accepted_tokens / counters.num_draft_tokens
                            if counters.num_draft_tokens else None),
        "mean_acceptance_length": counters.mean_acceptance_length,
        "per_position_acceptance": [n / drafts_for_positions for n in per_position or ()]
        if drafts_for_positions else [],
        "per_position_source": per_position_source,
    }


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def format_summary(summary: dict[str, Any]) -> str:
    def row(label: str, value: Any, digits: int = 2) -> str:
        if value is None:
            text = "-"
        elif isinstance(value, float):
            text = f"{value:.{digits}f}"
        else:
            text = str(value)
        return f"{label:<40}{text:>12}"

    def rule(title: str) -> str:
        return f"{title:-^52}"

    lines = [f"{' Serving Benchmark Result ':=^52}",
             row("Successful requests:", summary["completed"]),
             row("Failed requests:", summary["failed"]),
             row("Maximum request concurrency:", summary["max_concurrency"]),
             row("Request rate (req/s):", summary["request_rate"]),
             row("Benchmark duration (s):", summary["duration_s"]),
             row("Total input tokens:", summary["total_input_tokens"]),
             row("Total generated tokens:", summary["total_output_tokens"]),
             row("Request throughput (req/s):", summary["request_throughput"]),
             row("Output token throughput (tok/s):", summary["output_throughput"]),
             row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token "
                        "(excl. 1st token)"), ("itl", "Inter-token Latency"),
                        ("e2el", "End-to-end Latency")):
        lines.append(rule(title))
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms):"
            lines.append(row(label, summary[f"{stat}_{name}_ms"]))
    spec = summary["speculation"]
    lines += [rule(f"Speculation (from {spec['source']})"),
              row("Drafts:", spec["num_drafts"]),
              row("Draft tokens:", spec["num_draft_tokens"]),
              row("Accepted tokens:", spec["num_accepted_tokens"]),
              row("Acceptance rate (%):", None if spec["acceptance_rate"] is None
                  else 100 * spec["acceptance_rate"]),
              row("Mean acceptance length:", spec["mean_acceptance_length"]),
              f"Per-position acceptance (from {spec['per_position_source']}): "
              f"[{', '.join(f'{rate:.3f}' for rate in spec['per_position_acceptance'])}]"]
    if summary["errors"]:
        lines.append(rule("Errors"))
        lines += [f"{count:>6} x {message[:200]}" for message, count in summary["errors"].items()]
    lines.append("=" * 52)
    return "\n".join(lines)


def write_plot(summary: dict[str, Any], path: str) -> bool:
    """Per-position acceptance and per-request latency over the run; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed, so {path} was not written "
              "(pip install matplotlib to get plots)", file=sys.stderr)
        return False
    figure, (acceptance, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = summary["speculation"]["per_position_acceptance"]
    acceptance.bar(range(1, len(rates) + 1), rates)
    acceptance.set_xticks(range(1, len(rates) + 1))
    acceptance.set(title="Acceptance per draft position", xlabel="draft position",
                   ylabel="accepted / drafts", ylim=(0, 1))
    done = [r for r in summary["requests"] if r["success"]]
    latency.scatter([r["start_s"] for r in done], [r["e2e_ms"] for r in done], s=8, label="e2e")
    streamed = [r for r in done if r["ttft_ms"] is not None]
    latency.scatter([r["start_s"] for r in streamed], [r["ttft_ms"] for r in streamed], s=8,
                    label="TTFT")
    latency.set(title=f"Latency per request (concurrency {summary['max_concurrency'] or 'unbounded'})",
                xlabel="request start (s)", ylabel="ms")
    latency.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
