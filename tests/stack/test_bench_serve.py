"""`python -m specdec bench serve` against the launcher on the tiny model, as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from specdec.bench import serve as bench_serve
from specdec.bench.serve_compare import compare, round_orders
from specdec.bench.serve_report import parse_speculation_metrics
from specdec.bench.serve_requests import SHIPPED_DATASETS, load_requests
from tests.support.served_stack import ENV, ROOT, Stack, free_port, served_stack
from tests.support.tiny_models import make_tiny_llama

PRINTED_LABELS = [
    "Successful requests:", "Failed requests:", "Benchmark duration (s):",
    "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
    "Output token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):",
    "P99 TTFT (ms):", "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
    "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):", "Drafts:", "Draft tokens:",
    "Accepted tokens:", "Acceptance rate (%):", "Mean acceptance length:",
    "Per-position acceptance",
]
JSON_FIELDS = [
    "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "p99")),
    "speculation", "speculation_from_responses", "errors", "requests",
]
SPECULATION_FIELDS = ["num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                      "mean_acceptance_length", "per_position_acceptance"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-bench"))
    with served_stack(model, "--max-model-len", "512") as running:
        yield running


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specdec", "bench", "serve", *args], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)


def printed(stdout: str, label: str) -> str:
    match = re.search(rf"^{re.escape(label)}\s+(\S+)$", stdout, re.MULTILINE)
    assert match, f"{label!r} not printed:\n{stdout}"
    return match.group(1)


def test_prints_and_writes_every_figure(stack: Stack, tmp_path: Path) -> None:
    output, plot = tmp_path / "result.json", tmp_path / "plot.png"
    result = bench("--base-url", f"{stack.base_url}/v1", "--num-prompts", "20",
                   "--max-concurrency", "4", "--max-tokens", "16",
                   "--output-json", str(output), "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    for label in PRINTED_LABELS:
        assert label in result.stdout, label
    assert printed(result.stdout, "Successful requests:") == "20"
    assert printed(result.stdout, "Failed requests:") == "0"
    assert float(printed(result.stdout, "Output token throughput (tok/s):")) > 0
    assert "20/20" in result.stderr  # the progress bar

    summary = json.loads(output.read_text())
    for name in JSON_FIELDS:
        assert name in summary, name
    assert (summary["completed"], summary["failed"], summary["errors"]) == (20, 0, {})
    assert summary["model"] == httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"]
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in summary["requests"])
    assert all(summary[f"{stat}_{name}_ms"] > 0 for name in ("ttft", "tpot", "itl", "e2el")
               for stat in ("mean", "median", "p99"))
    speculation = summary["speculation"]
    for name in SPECULATION_FIELDS:
        assert name in speculation, name
    assert speculation["source"] == "metrics" and speculation["num_drafts"] > 0
    assert 1.0 <= speculation["mean_acceptance_length"] <= 4.0
    assert len(speculation["per_position_acceptance"]) == 3  # k
    # Nothing else used the server meanwhile: /metrics' counts are the responses' sums.
    from_responses = summary["speculation_from_responses"]
    assert all(speculation[name] == from_responses[name]
               for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in result.stderr and not plot.exists()
    else:
        assert plot.stat().st_size > 0


def test_jsonl_dataset(stack: Stack, tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "w5 w6 w7 w5 w6 w7", "max_tokens": 3},
             {"messages": [{"role": "system", "content": "w9"},
                           {"role": "user", "content": "w10 w11 w10 w11"}], "max_tokens": 5},
             {"prompt": "w20 w21"}]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    output = tmp_path / "result.json"
    result = bench("--base-url", stack.base_url, "--dataset", str(dataset), "--num-prompts", "6",
                   "--request-rate", "50", "--ignore-eos", "--max-concurrency", "2",
                   "--temperature", "0.7", "--disable-tqdm", "--output-json", str(output),
                   "--metrics-url", f"http://127.0.0.1:{free_port()}/metrics")
    assert result.returncode == 0, result.stderr
    summary = json.loads(output.read_text())
    assert (summary["completed"], summary["failed"]) == (6, 0)
    # No counters at --metrics-url: the responses' usage.speculation stands in.
    assert summary["speculation"]["source"] == "responses"
    # Lines cycle; "max_tokens" is per line (the default 128 where absent); ignore_eos.
    assert [r["output_tokens"] for r in summary["requests"]] == [3, 5, 128, 3, 5, 128]


def test_compares_speculation_settings_in_balanced_rounds(stack: Stack, tmp_path: Path) -> None:
    output = tmp_path / "compare.json"
    result = bench("--base-url", stack.base_url, "--num-prompts", "4", "--max-concurrency", "2",
                   "--max-tokens", "16", "--speculation", "off,on", "--rounds", "2",
                   "--disable-tqdm", "--output-json", str(output))
    assert result.returncode == 0, result.stderr
    runs = re.findall(r"^round (\d) speculation=(\w+): ([\d.]+) output tok/s", result.stdout,
                      re.MULTILINE)
    # --seed 0 draws off, on for the first pair; its second round runs the reverse.
    expected = [("1", "off"), ("1", "on"), ("2", "on"), ("2", "off")]
    assert [(r, setting) for r, setting, _ in runs] == expected
    assert "Comparison (2 rounds, order drawn per pair, reversed)" in result.stdout
    saved = json.loads(output.read_text())
    assert saved["settings"] == ["off", "on"] and saved["rounds"] == 2
    assert [(run["round"], run["setting"]) for run in saved["runs"]] == [
        (1, "off"), (1, "on"), (2, "on"), (2, "off")]
    assert all(run["completed"] == 4 and run["failed"] == 0 for run in saved["runs"])
    # Off drafts nothing (the per-request override); on drafts with the server's ngram.
    drafts = {run["setting"]: run["speculation_from_responses"]["num_drafts"]
              for run in saved["runs"]}
    assert drafts["off"] == 0 and drafts["on"] > 0
    on = saved["comparison"]["settings"]["on"]
    by_round = {(run["round"], run["setting"]): run["output_throughput"] for run in saved["runs"]}
    assert on["ratios"] == pytest.approx([by_round[(r, "on")] / by_round[(r, "off")] for r in (1, 2)])
    assert on["ci95"][0] <= on["mean_ratio"] <= on["ci95"][1]
    assert saved["comparison"]["settings"]["off"]["ratios"] == [1.0, 1.0]


def test_round_orders_are_drawn_per_pair_and_reversed() -> None:
    settings = ["off", "on", "2"]
    for seed in range(20):
        orders = round_orders(settings, 9, seed)
        assert len(orders) == 9 and orders == round_orders(settings, 9, seed)
        assert all(sorted(order) == sorted(settings) for order in orders)
        for first, second in zip(orders[0::2], orders[1::2]):
            assert second == first[::-1]  # each setting first as often as last over a pair
    # The draw varies with the seed (a fixed alternation would not).
    assert len({tuple(map(tuple, round_orders(["off", "on"], 8, seed))) for seed in range(20)}) > 1


def test_comparison_figures() -> None:
    runs = [{"round": r, "setting": setting, "output_throughput": value}
            for r, setting, value in [(1, "off", 100.0), (1, "on", 110.0), (2, "on", 90.0),
                                      (2, "off", 100.0), (3, "off", 200.0), (3, "on", 220.0)]]
    result = compare(["off", "on"], runs)
    on = result["settings"]["on"]
    assert on["ratios"] == pytest.approx([1.1, 0.9, 1.1])
    assert on["mean_ratio"] == pytest.approx(31 / 30)
    assert on["summed_ratio"] == pytest.approx(420 / 400)
    # mean +- t(0.975, 2 df) * stdev / sqrt(3)
    half = 4.303 * 0.11547005 / 3 ** 0.5
    assert on["ci95"] == pytest.approx([31 / 30 - half, 31 / 30 + half], rel=1e-5)
    assert result["settings"]["off"]["mean_output_throughput"] == pytest.approx(400 / 3)


@pytest.mark.parametrize("args,message", [
    (["--speculation", "off,maybe"], "--speculation takes on, off or a number"),
    (["--speculation", "on,ON"], "lists a setting twice"),
    (["--rounds", "3"], "give two or more"),
    (["--speculation", "off,on", "--rounds", "0"], "--rounds must be >= 1"),
    (["--speculation", "off,on", "--plot", "x.png"], "--plot draws one run"),
])
def test_bad_comparisons_are_refused(args: list[str], message: str, capsys) -> None:
    assert bench_serve.main(args) == 2
    assert message in capsys.readouterr().err


def test_server_down_reports_failures(tmp_path: Path) -> None:
    output = tmp_path / "result.json"
    result = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "5",
                   "--disable-tqdm", "--output-json", str(output))
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert printed(result.stdout, "Successful requests:") == "0"
    assert printed(result.stdout, "Failed requests:") == "5"
    assert "ConnectError" in result.stdout and "5 of 5 requests failed" in result.stderr
    assert json.loads(output.read_text())["failed"] == 5


@pytest.mark.parametrize("line,message", [
    ('{"prompt": 5}', 'line 1: needs "prompt"'),
    ('{"prompt": "hi", "max_tokens": 0}', '"max_tokens" must be an integer >= 1'),
    ("not json", "line 1: not JSON"),
])
def test_bad_dataset_is_refused(tmp_path: Path, line: str, message: str, capsys) -> None:
    dataset = tmp_path / "bad.jsonl"
    dataset.write_text(line + "\n")
    assert bench_serve.main(["--dataset", str(dataset)]) == 2
    assert message in capsys.readouterr().err


def test_the_shipped_datasets_load() -> None:
    """Every shipped --dataset name gives chat requests; 'repeat' is its eight paragraphs to
    repeat, cycled past them."""
    for name in SHIPPED_DATASETS:
        assert load_requests(name, None)
    repeat = load_requests("repeat", 10, max_tokens=96)
    assert len(repeat) == 10 and repeat[8] == repeat[0]
    assert all("Repeat the following paragraph" in str(request) for request in repeat)


def test_help_of_both_bench_commands() -> None:
    serve_help = bench("--help")
    assert serve_help.returncode == 0
    for flag in ("--base-url", "--model", "--num-prompts", "--request-rate", "--max-concurrency",
                 "--dataset", "--max-tokens", "--temperature", "--seed", "--api-key",
                 "--output-json", "--plot"):
        assert flag in serve_help.stdout, flag
    # `bench` alone keeps its meaning: the in-process single-request comparison.
    plain_help = subprocess.run([sys.executable, "-m", "specdec", "bench", "--help"], cwd=ROOT,
                                env=ENV, capture_output=True, text=True, timeout=120)
    assert plain_help.returncode == 0 and "--repeats" in plain_help.stdout


def test_parse_speculation_metrics_sums_label_sets() -> None:
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{model_name="a"} 3.0',
        'vllm:spec_decode_num_drafts_total{model_name="b"} 4.0',
        'vllm:spec_decode_num_drafts_created{model_name="a"} 1.7e9',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="0"} 5.0',
        ""])
    counters = parse_speculation_metrics(text)
    assert counters.exported and counters.num_drafts == 7.0
    assert counters.accepted_per_position == [5.0, 2.0]
    assert not parse_speculation_metrics("# nothing here\n").exported
