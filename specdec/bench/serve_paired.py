"""`bench serve --speculation on,off --paired`: settings compared request by request, held out.

`--rounds` repeats the same prompts, so a drafter that learns from earlier answers (suffix
decoding) has seen every answer before the timed rounds; and whole runs one after another
differ by the machine's drift (memory bandwidth moves 2x within minutes). Here the requests go
in waves of --max-concurrency: a wave's prompts are first prefilled once (max_tokens=1, no
speculation, untimed) so that every setting finds them in the prefix cache, then each setting
runs the wave, timed, in the order given. The first setting meets every answer first, and
the settings take turns within seconds, so drift weighs on all of them alike.

Each ratio comes with a 95% interval from a paired bootstrap over the block's waves (a wave
resampled keeps all its settings' figures), so that a difference smaller than the run
resolves reads as such. It covers the noise within the run only: runs on fresh servers
differ by more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from specdec.bench.serve_report import error_counts, responses_speculation
from specdec.bench.serve_requests import BenchRequest, RequestResult, send_request

DEFAULT_WARMUP = 16
BLOCKS = ("warmup", "rest", "overall")
# The bootstrap behind each ratio's interval: resamples, and the fewest waves it is drawn
# from (with fewer the resamples repeat a handful of values and the interval means little).
INTERVAL_RESAMPLES = 2000
MIN_INTERVAL_WAVES = 5
TABLE_WIDTH = 12 + 3 * (21 + 9) + 9 + 7


class Step(NamedTuple):
    """One batch sent at once: wave `wave`'s requests `indices`, with `setting` (None: the
    untimed prefill)."""

    wave: int
    setting: str | None
    indices: range


@dataclass(slots=True)
class PairedRun:
    """What the server answered: per setting, the results in request order and the
    wall-clock seconds of each wave; the prefill's results apart (untimed)."""

    model: str | None
    settings: list[str]
    concurrency: int
    waves: list[range]
    results: dict[str, list[RequestResult]]
    seconds: dict[str, list[float]]
    prefill: list[RequestResult]

    @property
    def num_requests(self) -> int:
        return sum(len(indices) for indices in self.waves)


# ------------------------------------------------------------------ the plan and the run

def waves(num_requests: int, concurrency: int) -> list[range]:
    """The requests in dataset order, cut into waves of `concurrency`."""
    return [range(start, min(start + concurrency, num_requests))
            for start in range(0, num_requests, concurrency)]


def wave_plan(num_requests: int, concurrency: int, settings: list[str]) -> list[Step]:
    """Per wave: the prefill, then every setting in the order given."""
    return [Step(number, setting, indices)
            for number, indices in enumerate(waves(num_requests, concurrency))
            for setting in (None, *settings)]


def prefill_request(request: BenchRequest) -> BenchRequest:
    """One token without speculation: puts the prompt in the prefix cache for every setting
    alike, and tells the drafter nothing of the answer."""
    return dataclasses.replace(request, max_tokens=1,
                               options={**request.options, "speculation": False})


async def run_paired(client: httpx.AsyncClient, model: str | None, settings: list[str],
                     requests_for: dict[str, list[BenchRequest]], concurrency: int,
                     on_result: Callable[[RequestResult], None] | None = None) -> PairedRun:
    """Sends `wave_plan`'s steps one after another; failures are recorded, never raised.
    `on_result` sees every timed result."""
    num_requests = len(requests_for[settings[0]])
    run = PairedRun(model, settings, concurrency, waves(num_requests, concurrency),
                    {setting: [] for setting in settings}, {setting: [] for setting in settings},
                    [])
    for step in wave_plan(num_requests, concurrency, settings):
        if step.setting is None:
            batch = [prefill_request(requests_for[settings[0]][i]) for i in step.indices]
            results, _ = await _send_wave(client, model, batch, step.indices)
            run.prefill += results
            continue
        batch = [requests_for[step.setting][i] for i in step.indices]
        results, seconds = await _send_wave(client, model, batch, step.indices)
        run.results[step.setting] += results
        run.seconds[step.setting].append(seconds)
        if on_result is not None:
            for result in results:
                on_result(result)
    return run


async def _send_wave(client: httpx.AsyncClient, model: str | None, batch: list[BenchRequest],
                     indices: range) -> tuple[list[RequestResult], float]:
    """The batch all at once; returns the results and the wall-clock seconds of the whole."""
    started = time.perf_counter()
    results = await asyncio.gather(*(send_request(client, request, model, RequestResult(index))
                                     for index, request in zip(indices, batch)))
    return list(results), time.perf_counter() - started


# ------------------------------------------------------------------ the figures

def block_waves(wave_list: list[range], warmup: int) -> dict[str, list[int]]:
    """Wave numbers per block: a wave that starts within the first `warmup` requests is a
    cold server's, the others are the rest's (whole waves, as they were timed whole)."""
    cold = [number for number, indices in enumerate(wave_list) if indices.start < warmup]
    warm = [number for number in range(len(wave_list)) if number not in cold]
    return {"warmup": cold, "rest": warm, "overall": list(range(len(wave_list)))}


def wave_tokens(run: PairedRun, setting: str, number: int) -> int:
    """Output tokens of wave `number`'s successful requests under `setting`."""
    results = run.results[setting]
    return sum(results[i].num_output_tokens for i in run.waves[number] if results[i].success)


def wave_figures(run: PairedRun, setting: str,
                 wave_numbers: Iterable[int]) -> list[tuple[int, float]]:
    """(output tokens, seconds) of each of these waves under `setting`."""
    return [(wave_tokens(run, setting, number), run.seconds[setting][number])
            for number in wave_numbers]


def block_figures(run: PairedRun, wave_numbers: list[int]) -> dict[str, Any]:
    """Per setting, over the given waves: output tokens of the successful requests, seconds,
    tokens/s, the ratio of that to the first setting's and the ratio's 95% interval
    (`ratio_interval`; None where there is no data or too few waves)."""
    indices = [i for number in wave_numbers for i in run.waves[number]]
    per_wave = {setting: wave_figures(run, setting, wave_numbers) for setting in run.settings}
    figures: dict[str, Any] = {}
    for setting, waves in per_wave.items():
        tokens = sum(count for count, _ in waves)
        seconds = sum(spent for _, spent in waves)
        figures[setting] = {"output_tokens": tokens, "seconds": seconds,
                            "output_throughput": tokens / seconds if seconds > 0 else None}
    reference = run.settings[0]
    reference_throughput = figures[reference]["output_throughput"]
    for setting, entry in figures.items():
        value = entry["output_throughput"]
        entry["ratio"] = (value / reference_throughput
                          if reference_throughput and value is not None else None)
        entry["ratio_ci95"] = (ratio_interval(per_wave[setting], per_wave[reference])
                               if setting != reference else None)
    return {"num_requests": len(indices), "settings": figures}


def ratio_interval(waves: list[tuple[int, float]], reference_waves: list[tuple[int, float]],
                   resamples: int = INTERVAL_RESAMPLES, seed: int = 0) -> list[float] | None:
    """A 95% interval of one setting's tokens/s over the reference's, from each wave's
    (tokens, seconds) under both (`wave_figures`, the same waves in the same order), by a
    paired bootstrap: the waves drawn with replacement, each keeping both settings' figures
    (the drift a wave met is common to its settings). None below MIN_INTERVAL_WAVES waves."""
    if len(waves) < MIN_INTERVAL_WAVES:
        return None
    pairs = [(*wave, *reference) for wave, reference in zip(waves, reference_waves, strict=True)]
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        tokens, seconds, reference_tokens, reference_seconds = (
            sum(column) for column in zip(*rng.choices(pairs, k=len(pairs))))
        if seconds > 0 and reference_tokens > 0 and reference_seconds > 0:
            ratios.append(tokens / seconds * reference_seconds / reference_tokens)
    if not ratios:
        return None
    ratios.sort()
    return [ratios[round(0.025 * (len(ratios) - 1))], ratios[round(0.975 * (len(ratios) - 1))]]


def acceptance_length(results: list[RequestResult]) -> float | None:
    """1 + accepted / drafts from the responses' usage.speculation; None without drafts."""
    return responses_speculation(results).mean_acceptance_length


def text_mismatches(run: PairedRun) -> list[int]:
    """Requests whose texts differ between settings (greedy decoding must not change with
    speculation); a request that failed somewhere is left out, there is nothing to compare."""
    mismatched = []
    for index in range(run.num_requests):
        answers = [run.results[setting][index] for setting in run.settings]
        if all(r.success for r in answers) and len({r.text for r in answers}) > 1:
            mismatched.append(index)
    return mismatched


def _outcome(results: list[RequestResult]) -> dict[str, Any]:
    failed = [r for r in results if not r.success]
    return {"completed": len(results) - len(failed), "failed": len(failed),
            "errors": error_counts(results)}


def summarise_paired(run: PairedRun, warmup: int = DEFAULT_WARMUP,
                     compare_texts: bool = True) -> dict[str, Any]:
    """Every figure of a paired run, JSON-ready. `compare_texts`: greedy decoding, where the
    settings' texts must agree."""
    blocks = block_waves(run.waves, warmup)
    mismatched = text_mismatches(run) if compare_texts else None
    return {
        "mode": "paired",
        "model": run.model,
        "settings": run.settings,
        "reference": run.settings[0],
        "num_requests": run.num_requests,
        "max_concurrency": run.concurrency,
        "warmup": warmup,
        "blocks": {name: block_figures(run, blocks[name]) for name in BLOCKS},
        "per_setting": {setting: {"acceptance_length": acceptance_length(run.results[setting]),
                                  **_outcome(run.results[setting])}
                        for setting in run.settings},
        "prefill": _outcome(run.prefill),
        "mismatches": {"compared": compare_texts,
                       "count": None if mismatched is None else len(mismatched),
                       "indices": mismatched or []},
    }


# ------------------------------------------------------------------ output

def _cell(value: float | None, text: str) -> str:
    return "-" if value is None else text.format(value)


def format_paired(summary: dict[str, Any]) -> str:
    """A row per setting: tokens/s and ratio to the first setting per block, acceptance
    length, failures; then the texts' agreement and any errors."""
    reference, blocks = summary["reference"], summary["blocks"]
    title = (f" Paired comparison ({summary['num_requests']} requests, waves of "
             f"{summary['max_concurrency']}, held out) ")
    counts = {name: blocks[name]["num_requests"] for name in BLOCKS}
    head = "".join(f"{f'{name} ({counts[name]}) tok/s':>21}{f'vs {reference}':>9}"
                   for name in BLOCKS)
    lines = [f"{title:-^{TABLE_WIDTH}}", f"{'speculation':<12}{head}{'acc len':>9}{'failed':>7}"]
    for setting, outcome in summary["per_setting"].items():
        entries = [blocks[name]["settings"][setting] for name in BLOCKS]
        cells = "".join(f"{_cell(entry['output_throughput'], '{:.2f}'):>21}"
                        f"{_cell(entry['ratio'], '{:.3f}x'):>9}" for entry in entries)
        lines.append(f"{setting:<12}{cells}"
                     f"{_cell(outcome['acceptance_length'], '{:.2f}'):>9}{outcome['failed']:>7}")
        if setting != reference:
            intervals = "".join(f"{_interval(entry['ratio_ci95']):>30}" for entry in entries)
            lines.append(f"{'  95% CI':<12}{intervals}")
    lines.append(_agreement(summary))
    lines += _error_lines(summary)
    return "\n".join(lines)


def _interval(bounds: list[float] | None) -> str:
    return "-" if bounds is None else f"{bounds[0]:.3f}-{bounds[1]:.3f}x"


def _agreement(summary: dict[str, Any]) -> str:
    mismatches = summary["mismatches"]
    if not mismatches["compared"]:
        return "Texts not compared (temperature > 0)"
    return (f"Texts differ between settings in {mismatches['count']} of "
            f"{summary['num_requests']} requests")


def _error_lines(summary: dict[str, Any]) -> list[str]:
    """Each setting's errors (and the prefill's), most frequent first, as format_summary
    lists them."""
    outcomes = {**summary["per_setting"], "prefill": summary["prefill"]}
    lines = []
    for name, outcome in outcomes.items():
        lines += [f"{count:>6} x {name}: {message[:200]}"
                  for message, count in outcome["errors"].items()]
    return [f"{' Errors ':-^{TABLE_WIDTH}}", *lines] if lines else []


def mismatch_warning(summary: dict[str, Any]) -> str | None:
    """A line naming the requests whose texts differ; None when they all agree."""
    indices = summary["mismatches"]["indices"]
    if not indices:
        return None
    return (f"warning: greedy texts differ between settings {', '.join(summary['settings'])} "
            f"in requests {', '.join(map(str, indices))}")


def report_paired(summary: dict[str, Any], output_json: str | None) -> int:
    """Prints the table (a warning on stderr for differing texts), writes --output-json;
    returns the exit status: 1 when any request failed, else 0."""
    print(format_paired(summary))
    warning = mismatch_warning(summary)
    if warning:
        print(warning, file=sys.stderr)
    if output_json:
        Path(output_json).write_text(json.dumps(summary, indent=2) + "\n")
    outcomes = [*summary["per_setting"].values(), summary["prefill"]]
    failed = sum(outcome["failed"] for outcome in outcomes)
    if failed:
        print(f"{failed} requests failed over {len(summary['settings'])} settings and the "
              f"prefill", file=sys.stderr)
        return 1
    return 0
