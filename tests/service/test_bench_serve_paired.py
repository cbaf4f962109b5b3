"""`bench serve --speculation on,off --paired`: the wave plan as the server sees it (through the
real gateway on the fake verifier), the figures per block, differing texts, failures, the
refused flag combinations and the JSON written."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from specdec.bench import serve as bench_serve
from specdec.bench.serve_paired import (
    MIN_INTERVAL_WAVES,
    PairedRun,
    format_paired,
    mismatch_warning,
    prefill_request,
    ratio_interval,
    summarise_paired,
    wave_figures,
    wave_plan,
)
from specdec.bench.serve_requests import BenchRequest, RequestResult
from specdec.v1 import specdec_pb2
from tests.support import fake_verifier as fake

MAX_TOKENS = 8  # under REPLY_TEXT's length: every request answers exactly this many tokens


@dataclass
class Served:
    base_url: str
    verifier: fake.FakeVerifier
    tokenizer: Any

    def index_of(self, request: specdec_pb2.GenerateRequest) -> int:
        """The dataset line a request came from: its prompt says `req<i>`."""
        return int(re.search(r"req(\d+)", self.tokenizer.decode(request.prompt_token_ids))[1])

    def seen(self, request: specdec_pb2.GenerateRequest) -> tuple[int, int, bool, int]:
        """(line, max_tokens, speculation enabled, speculative tokens) of a request."""
        return (self.index_of(request), request.sampling.max_tokens,
                request.speculation.enabled, request.speculation.num_speculative_tokens)


@pytest.fixture(scope="module")
def served(tokenizer) -> Iterator[Served]:
    with fake.live_gateway(tokenizer) as (gateway, verifier):
        yield Served(gateway.base_url, verifier, tokenizer)


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"hello req{i} world"}) + "\n" for i in range(5)))
    return path


def paired(served: Served, dataset: Path, output: Path, *flags: str) -> int:
    return bench_serve.main(["--base-url", served.base_url, "--dataset", str(dataset),
                             "--max-tokens", str(MAX_TOKENS), "--disable-tqdm", "--paired",
                             "--output-json", str(output), *flags])


# ------------------------------------------------------------------ through the gateway

def test_server_sees_prefill_then_each_setting_per_wave(served: Served, dataset: Path,
                                                        tmp_path: Path, capsys) -> None:
    before = len(served.verifier.requests)
    output = tmp_path / "paired.json"
    code = paired(served, dataset, output, "--speculation", "on,off,2", "--max-concurrency", "2",
                  "--paired-warmup", "2")
    assert code == 0, capsys.readouterr()
    seen = [served.seen(request) for request in served.verifier.requests[before:]]
    # Waves {0, 1}, {2, 3}, {4}: the prefill (1 token, speculation off), then on, off, 2.
    expected: list[set[tuple[int, int, bool, int]]] = []
    for wave in ([0, 1], [2, 3], [4]):
        expected += [{(i, 1, False, 0) for i in wave}, {(i, MAX_TOKENS, True, 0) for i in wave},
                     {(i, MAX_TOKENS, False, 0) for i in wave},
                     {(i, MAX_TOKENS, True, 2) for i in wave}]
    batches, start = [], 0
    for batch in expected:  # a wave's requests are concurrent: their order within it is free
        batches.append(set(seen[start:start + len(batch)]))
        start += len(batch)
    assert start == len(seen) and batches == expected

    summary = json.loads(output.read_text())
    assert (summary["mode"], summary["settings"], summary["reference"]) == (
        "paired", ["on", "off", "2"], "on")
    assert (summary["num_requests"], summary["max_concurrency"], summary["warmup"]) == (5, 2, 2)
    blocks = summary["blocks"]
    assert [blocks[name]["num_requests"] for name in ("warmup", "rest", "overall")] == [2, 3, 5]
    for name, count in (("warmup", 2), ("rest", 3), ("overall", 5)):
        figures = blocks[name]["settings"]
        assert figures["on"]["ratio"] == 1.0
        for entry in figures.values():
            assert entry["output_tokens"] == count * MAX_TOKENS
            assert entry["output_throughput"] == pytest.approx(entry["output_tokens"]
                                                               / entry["seconds"])
        assert figures["off"]["ratio"] == pytest.approx(
            figures["off"]["output_throughput"] / figures["on"]["output_throughput"])
    # The seconds of the blocks are those of their waves.
    for setting in ("on", "off", "2"):
        assert blocks["overall"]["settings"][setting]["seconds"] == pytest.approx(
            blocks["warmup"]["settings"][setting]["seconds"]
            + blocks["rest"]["settings"][setting]["seconds"])
    # The fake verifier reports accepted drafts in every answer (steps of 1, 3, 2, 4 tokens).
    assert all(entry["acceptance_length"] > 1 and entry["failed"] == 0
               for entry in summary["per_setting"].values())
    assert summary["mismatches"] == {"compared": True, "count": 0, "indices": []}
    printed = capsys.readouterr().out
    assert "Paired comparison (5 requests, waves of 2, held out)" in printed
    assert re.search(r"^on\s+[\d.]+\s+1\.000x\s+[\d.]+\s+1\.000x\s+[\d.]+\s+1\.000x", printed,
                     re.MULTILINE)
    assert "Texts differ between settings in 0 of 5 requests" in printed


def test_one_at_a_time_by_default(served: Served, dataset: Path, tmp_path: Path) -> None:
    before = len(served.verifier.requests)
    assert paired(served, dataset, tmp_path / "out.json", "--speculation", "off,on") == 0
    seen = [served.seen(request) for request in served.verifier.requests[before:]]
    assert seen == [step for i in range(5) for step in
                    [(i, 1, False, 0), (i, MAX_TOKENS, False, 0), (i, MAX_TOKENS, True, 0)]]
    summary = json.loads((tmp_path / "out.json").read_text())
    # The default warmup (16) covers all five requests: the rest is empty.
    assert summary["blocks"]["warmup"]["num_requests"] == 5
    assert summary["blocks"]["rest"]["settings"]["on"] == {
        "output_tokens": 0, "seconds": 0, "output_throughput": None, "ratio": None,
        "ratio_ci95": None}
    # Five one-request waves: the least a ratio gets an interval from.
    low, high = summary["blocks"]["warmup"]["settings"]["on"]["ratio_ci95"]
    assert 0 < low <= summary["blocks"]["warmup"]["settings"]["on"]["ratio"] <= high


def test_differing_texts_are_counted_and_named(served: Served, dataset: Path, tmp_path: Path,
                                               capsys) -> None:
    other = served.tokenizer.encode("the quick brown fox", add_special_tokens=False)

    def reply_for(request: specdec_pb2.GenerateRequest) -> list[int] | None:
        speculating = request.speculation.enabled
        return other if speculating and served.index_of(request) in (1, 3) else None

    served.verifier.reply_for = reply_for
    try:
        code = paired(served, dataset, tmp_path / "out.json", "--speculation", "on,off")
    finally:
        served.verifier.reply_for = None
    assert code == 0  # a warning, not a failure
    captured = capsys.readouterr()
    assert "Texts differ between settings in 2 of 5 requests" in captured.out
    assert "warning: greedy texts differ between settings on, off in requests 1, 3" in captured.err
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["mismatches"] == {"compared": True, "count": 2, "indices": [1, 3]}

    # Sampling at temperature > 0 may differ by design: nothing is compared.
    served.verifier.reply_for = reply_for
    try:
        paired(served, dataset, tmp_path / "hot.json", "--speculation", "on,off",
               "--temperature", "0.5")
    finally:
        served.verifier.reply_for = None
    assert json.loads((tmp_path / "hot.json").read_text())["mismatches"] == {
        "compared": False, "count": None, "indices": []}
    assert "Texts not compared (temperature > 0)" in capsys.readouterr().out


def test_failures_are_reported_and_the_run_goes_on(served: Served, dataset: Path,
                                                   tmp_path: Path, capsys) -> None:
    # The fake verifier drafts 3 tokens at most: the gateway refuses speculation 5.
    code = paired(served, dataset, tmp_path / "out.json", "--speculation", "on,5")
    captured = capsys.readouterr()
    assert code == 1
    assert "5 requests failed over 2 settings and the prefill" in captured.err
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["per_setting"]["on"]["failed"] == 0
    assert summary["per_setting"]["5"]["failed"] == 5
    [(message, count)] = summary["per_setting"]["5"]["errors"].items()
    assert count == 5 and "speculation must be at most" in message
    assert f"5 x 5: {message}" in captured.out
    overall = summary["blocks"]["overall"]["settings"]
    assert overall["on"]["output_tokens"] == 5 * MAX_TOKENS and overall["5"]["output_tokens"] == 0
    assert overall["5"]["ratio"] == 0.0
    assert summary["mismatches"]["count"] == 0  # nothing to compare where a setting failed


# ------------------------------------------------------------------ the pure parts

def test_wave_plan_prefills_each_wave_then_runs_the_settings_in_order() -> None:
    plan = wave_plan(5, 2, ["on", "off"])
    assert [(step.wave, step.setting, list(step.indices)) for step in plan] == [
        (0, None, [0, 1]), (0, "on", [0, 1]), (0, "off", [0, 1]),
        (1, None, [2, 3]), (1, "on", [2, 3]), (1, "off", [2, 3]),
        (2, None, [4]), (2, "on", [4]), (2, "off", [4])]


def test_prefill_request_asks_one_token_without_speculation() -> None:
    request = BenchRequest(prompt="p", max_tokens=64,
                           options={"temperature": 0.0, "speculation": True})
    prefill = prefill_request(request)
    assert (prefill.max_tokens, prefill.options) == (1, {"temperature": 0.0, "speculation": False})
    assert prefill.prompt == "p" and request.options["speculation"] is True  # a copy


def result(index: int, tokens: int = 10, text: str = "same", success: bool = True,
           speculation: dict[str, Any] | None = None) -> RequestResult:
    return RequestResult(index, success=success, text=text, num_output_tokens=tokens,
                         error="" if success else "HTTP 500: boom", speculation=speculation)


def synthetic_run() -> PairedRun:
    """Six requests in waves of two; `off` is slower, failed request 5 and answered request
    1 otherwise; `on` drafted."""
    on = [result(i, speculation={"num_drafts": 4, "num_accepted_tokens": 6}) for i in range(6)]
    off = [result(0), result(1, text="other"), result(2), result(3), result(4),
           result(5, text="lost", success=False)]
    return PairedRun(model="m", settings=["on", "off"], concurrency=2,
                     waves=[range(2), range(2, 4), range(4, 6)],
                     results={"on": on, "off": off},
                     seconds={"on": [1.0, 2.0, 2.0], "off": [2.0, 4.0, 3.0]},
                     prefill=[result(i, tokens=1) for i in range(6)])


def test_figures_per_block_and_ratio_to_the_first_setting() -> None:
    summary = summarise_paired(synthetic_run(), warmup=2)
    blocks = summary["blocks"]
    warm, rest, overall = (blocks[name]["settings"] for name in ("warmup", "rest", "overall"))
    assert [blocks[name]["num_requests"] for name in ("warmup", "rest", "overall")] == [2, 4, 6]
    assert (warm["on"]["output_throughput"], warm["off"]["output_throughput"]) == (20.0, 10.0)
    assert (warm["on"]["ratio"], warm["off"]["ratio"]) == (1.0, 0.5)
    # The failed request's tokens count for nothing; its wave's seconds still count.
    assert (rest["off"]["output_tokens"], rest["off"]["seconds"]) == (30, 7.0)
    assert rest["off"]["ratio"] == pytest.approx((30 / 7) / (40 / 4))
    assert overall["off"]["ratio"] == pytest.approx((50 / 9) / (60 / 5))
    per_setting = summary["per_setting"]
    assert per_setting["on"]["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert per_setting["off"]["acceptance_length"] is None
    assert (per_setting["off"]["failed"], per_setting["off"]["errors"]) == (1, {"HTTP 500: boom": 1})
    # Request 1 differs; request 5 failed under off, so it is not compared.
    assert summary["mismatches"] == {"compared": True, "count": 1, "indices": [1]}
    assert json.loads(json.dumps(summary)) == summary  # JSON-ready


def test_warmup_takes_whole_waves() -> None:
    run = synthetic_run()
    blocks = summarise_paired(run, warmup=3)["blocks"]
    assert blocks["warmup"]["num_requests"] == 4  # wave {2, 3} starts within the first 3
    assert blocks["warmup"]["settings"]["on"]["seconds"] == 3.0
    cold = summarise_paired(run, warmup=0)["blocks"]
    assert cold["warmup"]["num_requests"] == 0
    assert cold["warmup"]["settings"]["off"] == {"output_tokens": 0, "seconds": 0,
                                                 "output_throughput": None, "ratio": None,
                                                 "ratio_ci95": None}
    assert cold["rest"] == cold["overall"]


def test_table_and_warning() -> None:
    summary = summarise_paired(synthetic_run(), warmup=2)
    table = format_paired(summary).splitlines()
    assert "Paired comparison (6 requests, waves of 2, held out)" in table[0]
    assert table[1].split() == ["speculation", "warmup", "(2)", "tok/s", "vs", "on", "rest", "(4)",
                                "tok/s", "vs", "on", "overall", "(6)", "tok/s", "vs", "on",
                                "acc", "len", "failed"]
    assert table[2].split() == ["on", "20.00", "1.000x", "10.00", "1.000x", "12.00", "1.000x",
                                "2.50", "0"]
    assert table[3].split() == ["off", "10.00", "0.500x", "4.29", "0.429x", "5.56", "0.463x",
                                "-", "1"]
    assert table[4].split() == ["95%", "CI", "-", "-", "-"]  # three waves: too few for one
    assert table[5] == "Texts differ between settings in 1 of 6 requests"
    assert table[7].split() == ["1", "x", "off:", "HTTP", "500:", "boom"]
    assert mismatch_warning(summary) == (
        "warning: greedy texts differ between settings on, off in requests 1")
    assert mismatch_warning(summarise_paired(synthetic_run(), compare_texts=False)) is None


def timed_run(seconds_on: list[float], seconds_off: list[float], tokens: int = 10) -> PairedRun:
    """One request a wave, `tokens` each, the given wave seconds per setting."""
    num = len(seconds_on)
    return PairedRun(model="m", settings=["on", "off"], concurrency=1,
                     waves=[range(i, i + 1) for i in range(num)],
                     results={setting: [result(i, tokens=tokens) for i in range(num)]
                              for setting in ("on", "off")},
                     seconds={"on": seconds_on, "off": seconds_off}, prefill=[])


def off_interval(run: PairedRun, num_waves: int) -> list[float] | None:
    """The interval of off against on over the run's first `num_waves` waves."""
    return ratio_interval(wave_figures(run, "off", range(num_waves)),
                          wave_figures(run, "on", range(num_waves)))


def test_ratio_interval_is_a_paired_bootstrap_over_the_waves() -> None:
    # The machine's speed moves 1x-10x from wave to wave, but off always takes twice as
    # long: resampling whole waves keeps each pair together, so the interval is exactly 0.5.
    drift = [1.0, 7.0, 3.0, 10.0, 2.0, 5.0, 8.0, 4.0]
    run = timed_run(drift, [2 * seconds for seconds in drift])
    assert off_interval(run, 8) == [pytest.approx(0.5), pytest.approx(0.5)]
    # Identical settings with noise of their own: an interval around 1 that the noise widens.
    noise = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.08, 0.92]
    run = timed_run(drift, [seconds * factor for seconds, factor in zip(drift, noise)])
    low, high = off_interval(run, 8)
    assert low < 1.0 < high and high - low > 0.02
    narrow = timed_run(drift, [seconds * (1 + (factor - 1) / 10)
                               for seconds, factor in zip(drift, noise)])
    narrow_low, narrow_high = off_interval(narrow, 8)
    assert high - low > 5 * (narrow_high - narrow_low)
    # Drawn with a fixed seed: the same run gives the same interval.
    assert off_interval(run, 8) == [low, high]
    # Too few waves for a bootstrap to mean anything.
    assert off_interval(run, MIN_INTERVAL_WAVES - 1) is None


def test_each_ratio_gets_its_interval_in_the_summary_and_the_table() -> None:
    drift = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    summary = summarise_paired(timed_run(drift, [2 * seconds for seconds in drift]), warmup=1)
    blocks = summary["blocks"]
    assert blocks["warmup"]["settings"]["off"]["ratio_ci95"] is None  # one wave
    assert blocks["rest"]["settings"]["off"]["ratio_ci95"] == [pytest.approx(0.5)] * 2
    assert blocks["overall"]["settings"]["on"]["ratio_ci95"] is None  # the reference
    table = format_paired(summary).splitlines()
    assert table[4].split() == ["95%", "CI", "-", "0.500-0.500x", "0.500-0.500x"]


# ------------------------------------------------------------------ the flags

@pytest.mark.parametrize("args,message", [
    (["--paired"], "--paired compares settings: give two or more"),
    (["--speculation", "on", "--paired"], "--paired compares settings: give two or more"),
    (["--speculation", "on,off", "--paired", "--rounds", "3"], "leave out --rounds"),
    (["--speculation", "on,off", "--paired", "--request-rate", "4"], "leave out --request-rate"),
    (["--speculation", "on,off", "--paired-warmup", "4"], "--paired-warmup needs --paired"),
    (["--speculation", "on,off", "--paired", "--paired-warmup", "-1"],
     "--paired-warmup must be >= 0"),
])
def test_bad_paired_flags_are_refused(args: list[str], message: str, capsys) -> None:
    assert bench_serve.main(args) == 2
    assert message in capsys.readouterr().err


def test_help_describes_paired() -> None:
    text = " ".join(bench_serve.build_parser().format_help().split())
    assert "--paired with several --speculation settings: held-out comparison" in text
    assert "--paired-warmup N with --paired: the first N requests" in text
