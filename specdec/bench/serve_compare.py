"""`bench serve --speculation off,on --rounds N`: settings compared side by side, one server.

A machine's speed drifts between runs (memory bandwidth here moves by 2x within minutes),
so two settings measured one after the other differ by more than a setting changes. Each
round runs the same requests once per setting, and each round's throughput ratio against
the first setting is taken within the round. The comparison reports those ratios, their
mean with a 95% confidence interval (Student's t over the rounds) and the ratio of summed
throughputs.

The order: each pair of rounds runs the settings in an order drawn at random (seeded), then
in its reverse, so every setting runs first as often as last. A fixed alternation (off, on;
on, off; off, on; ...) lines the settings up with any drift whose period is about four runs:
here it once reported speculation at c = 8 as 1.108x [1.054, 1.161] in eight rounds,
while the same server, switching speculation on and off every second inside one run,
measured 0.93-1.00x (drafts touched under 1% of the tokens, so nothing could have made 10%).
A drawn order turns such a drift into spread, which the interval then shows.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

# Student's t, two-sided 95%, by degrees of freedom (1.96 beyond the table).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
        16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}


def parse_speculation(text: str) -> bool | int:
    """One `--speculation` value: on / off, or a number of speculative tokens."""
    value = text.strip().lower()
    if value in ("on", "off"):
        return value == "on"
    if value.isdigit():
        return int(value)
    raise ValueError(f"--speculation takes on, off or a number (comma-separated to compare), "
                     f"got {text!r}")


def parse_settings(text: str) -> list[str]:
    """The comma-separated `--speculation` settings, each checked, none repeated."""
    settings = [part.strip() for part in text.split(",")]
    for setting in settings:
        parse_speculation(setting)
    if len({setting.lower() for setting in settings}) != len(settings):
        raise ValueError(f"--speculation lists a setting twice: {text!r}")
    return settings


def t95(degrees_of_freedom: int) -> float:
    known = [df for df in _T95 if df <= degrees_of_freedom]
    return _T95[max(known)] if degrees_of_freedom <= 30 else 1.96


def round_orders(settings: list[str], rounds: int, seed: int) -> list[list[str]]:
    """The settings' order in each round: per pair of rounds a seeded random order, then its
    reverse (see the module docstring)."""
    rng = random.Random(seed)
    orders: list[list[str]] = []
    while len(orders) < rounds:
        order = list(settings)
        rng.shuffle(order)
        orders += [order, order[::-1]]
    return orders[:rounds]


async def run_rounds(settings: list[str], rounds: int,
                     run_one: Callable[[str], Awaitable[dict[str, Any]]],
                     on_run: Callable[[int, str, dict[str, Any]], None] | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Each round runs every setting once (`run_one(setting)` -> its summary), in the order
    `round_orders` draws from `seed`; returns the summaries tagged with "round" and
    "setting" (the --speculation value), in the order they ran."""
    runs = []
    for round_index, order in enumerate(round_orders(settings, rounds, seed)):
        for setting in order:
            summary = await run_one(setting)
            runs.append({"round": round_index + 1, "setting": setting, **summary})
            if on_run is not None:
                on_run(round_index + 1, setting, summary)
    return runs


def compare(settings: list[str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting: mean output throughput and, against the first setting, the per-round
    ratios, their mean with a 95% interval (None with one round) and the summed ratio."""
    throughput: dict[str, dict[int, float]] = {setting: {} for setting in settings}
    for run in runs:
        throughput[run["setting"]][run["round"]] = run["output_throughput"]
    reference = throughput[settings[0]]
    result: dict[str, Any] = {"reference": settings[0], "settings": {}}
    for setting in settings:
        values = throughput[setting]
        entry: dict[str, Any] = {"output_throughput": [values[r] for r in sorted(values)],
                                 "mean_output_throughput": statistics.fmean(values.values())}
        rounds = [r for r in sorted(values) if reference.get(r)]
        ratios = [values[r] / reference[r] for r in rounds]
        entry["ratios"] = ratios
        entry["mean_ratio"] = statistics.fmean(ratios) if ratios else None
        entry["summed_ratio"] = (sum(values[r] for r in rounds) / sum(reference[r] for r in rounds)
                                 if rounds else None)
        entry["ci95"] = None
        if len(ratios) >= 2:
            half = t95(len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))
            entry["ci95"] = [entry["mean_ratio"] - half, entry["mean_ratio"] + half]
        result["settings"][setting] = entry
    return result


def format_run(round_index: int, setting: str, summary: dict[str, Any]) -> str:
    speculation = summary.get("speculation") or {}
    drafts = speculation.get("num_drafts")
    accepted = speculation.get("num_accepted_tokens")
    extra = f", {drafts} drafts, {accepted} accepted tokens" if drafts else ""
    return (f"round {round_index} speculation={setting}: {summary['output_throughput']:.2f} "
            f"output tok/s, {summary['completed']} ok / {summary['failed']} failed{extra}")


def format_comparison(comparison: dict[str, Any], rounds: int) -> str:
    reference = comparison["reference"]
    lines = [f"{f' Comparison ({rounds} rounds, order drawn per pair, reversed) ':-^72}",
             f"{'speculation':<12}{'mean tok/s':>12}{f'vs {reference}':>10}{'95% CI':>20}"
             f"{'summed':>9}  per round"]
    for setting, entry in comparison["settings"].items():
        ratio = entry["mean_ratio"]
        interval = entry["ci95"]
        ci = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "-"
        summed = entry["summed_ratio"]
        lines.append(f"{setting:<12}{entry['mean_output_throughput']:>12.2f}"
                     f"{'-' if ratio is None else f'{ratio:.3f}x':>10}{ci:>20}"
                     f"{'-' if summed is None else f'{summed:.3f}x':>9}  "
                     + " ".join(f"{value:.3f}" for value in entry["ratios"]))
    return "\n".join(lines)
