"""`python -m specdec bench concurrency`: speculation switched on and off inside one engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.__main__ import main
from specdec.bench.concurrency import step_seconds, summarise
from specdec.layers.cpu_extension import linear_supports
from tests.support.tiny_models import make_tiny_llama
from specdec.engine.step_record import StepRecord


def steps(pattern: list[tuple[bool, float, int, int, int]], gap_after: dict[int, float] | None = None,
          ) -> list[StepRecord]:
    """Back-to-back steps of (speculation on, seconds, sequences, output tokens, prefill
    tokens); `gap_after`: idle seconds after the step at that index."""
    records, clock = [], 0.0
    for index, (enabled, seconds, sequences, tokens, prefill) in enumerate(pattern):
        records.append(StepRecord(clock, clock + seconds, enabled, sequences, prefill,
                                  4 if enabled else 0, tokens))
        clock += seconds + (gap_after or {}).get(index, 0.0)
    return records


def test_a_step_counts_the_time_to_the_next_unless_the_engine_went_idle() -> None:
    records = steps([(False, 0.010, 8, 8, 0), (False, 0.010, 8, 8, 0), (True, 0.020, 8, 8, 0)],
                    gap_after={0: 0.002, 1: 5.0})
    assert step_seconds(records) == pytest.approx([0.012, 0.010, 0.020])


def test_ratios_of_a_known_run() -> None:
    # Periods of three steps. Off: 8 tokens in 10 ms (800 tok/s); on: 12 tokens in 12 ms at
    # 8 sequences (1000 tok/s) and 4 tokens in 5 ms at 4 (800 tok/s against off's 4 in 8 ms,
    # 500 tok/s). Off's first period opens with a 40 ms prefill step of 8 tokens.
    off = [(False, 0.010, 8, 8, 0)] * 3
    on = [(True, 0.012, 8, 12, 0)] * 3
    pattern = [(False, 0.040, 8, 8, 64)] + off + on + off + on + off + on + [
        (False, 0.008, 4, 4, 0)] * 5 + [(True, 0.005, 4, 4, 0)] * 5
    summary = summarise(steps(pattern))
    decode = summary["decode_steps"]
    assert decode["off"]["tokens"] == 9 * 8 + 5 * 4 and decode["on"]["tokens"] == 9 * 12 + 5 * 4
    assert decode["off"]["seconds"] == pytest.approx(9 * 0.010 + 5 * 0.008)
    assert decode["on_over_off"] == pytest.approx((128 / 0.133) / (92 / 0.130), abs=1e-4)
    assert summary["all_steps"]["off"]["steps"] == decode["off"]["steps"] + 1
    # With the batch size held fixed: 1.25 at eight sequences, 1.6 at four, weighted by time.
    sizes = {row["sequences"]: row["on_over_off"] for row in summary["by_batch_size"]["sizes"]}
    assert sizes == {8: 1.25, 4: 1.6}
    weight8, weight4 = 9 * 0.010 + 9 * 0.012, 5 * 0.008 + 5 * 0.005
    assert summary["by_batch_size"]["on_over_off"] == pytest.approx(
        (1.25 * weight8 + 1.6 * weight4) / (weight8 + weight4), abs=1e-4)
    # Each on-period against the off-periods beside it together: the first's include the
    # prefill step, the third's the 4-sequence period.
    paired = summary["paired_periods"]
    ratios = [1000 / (56 / 0.100), 1000 / 800, 1000 / (44 / 0.070), 800 / 500]
    assert paired["num_pairs"] == 4
    assert paired["median"] == pytest.approx(sorted(ratios)[1] / 2 + sorted(ratios)[2] / 2, abs=1e-4)
    low, high = paired["ci95"]
    assert low <= paired["geometric_mean"] <= high
    common = summary["at_common_size"]
    assert common["sequences"] == 8
    assert common["on_with_drafts"]["tokens_per_step"] == 12 and common["on_without_drafts"]["steps"] == 0
    assert common["off"]["tokens_per_s"] == 800.0 and common["on_with_drafts"]["tokens_per_s"] == 1000.0


def test_drafting_steps_split_into_planned_drafts_and_probes_only() -> None:
    """At the common batch size on's drafting steps are split by what they carried: a draft
    the policy planned to pay (probes beside it or not), or probes alone (exploration)."""
    records, clock = [], 0.0
    # (on, seconds, output tokens, draft slots, probes among them)
    for enabled, seconds, tokens, slots, probes in [(False, 0.010, 8, 0, 0)] * 3 + [
            (True, 0.012, 12, 6, 0), (True, 0.013, 11, 5, 2), (True, 0.011, 8, 2, 2),
            (True, 0.011, 9, 3, 3), (True, 0.010, 8, 0, 0)]:
        records.append(StepRecord(clock, clock + seconds, enabled, 8, 0, slots, tokens, probes))
        clock += seconds
    common = summarise(records)["at_common_size"]
    planned, probing = common["on_with_planned_drafts"], common["on_with_probes_only"]
    assert common["on_with_drafts"]["steps"] == 4 and common["on_without_drafts"]["steps"] == 1
    assert (planned["steps"], planned["tokens"], planned["draft_slots"]) == (2, 23, 11)
    assert planned["seconds"] == pytest.approx(0.025)
    assert (probing["steps"], probing["tokens"], probing["draft_slots"]) == (2, 17, 5)
    assert probing["tokens_per_s"] == pytest.approx(17 / 0.022, abs=0.01)


def test_runs_an_engine_and_reports_each_concurrency(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "concurrency.json"
    assert main(["bench", "concurrency", "--model", str(model), "--dtype", "float32",
                 "--num-prompts", "6", "--max-concurrency", "2,3", "--max-tokens", "24",
                 "--period", "0.005", "--ignore-eos", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "concurrency 2: 6 requests" in printed and "concurrency 3: 6 requests" in printed
    assert "of which planned drafts" in printed and "of which probes only" in printed
    runs = json.loads(out.read_text())["runs"]
    assert [run["concurrency"] for run in runs] == [2, 3]
    for run in runs:
        steps_run = run["all_steps"]
        # Both settings served steps, and every request's tokens were counted.
        assert steps_run["off"]["steps"] > 0 and steps_run["on"]["steps"] > 0
        assert steps_run["off"]["tokens"] + steps_run["on"]["tokens"] == 6 * 24
        assert steps_run["off"]["draft_slots"] == 0


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "concurrency", "--max-concurrency", "8,x"])
    assert info.value.code == 2 and "comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["bench", "concurrency", "--period", "0"])
    assert info.value.code == 2


def test_batch_invariance_is_switched_against_sdpa(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--compare batch-invariance: speculation off, the stack's prefill attention switched
    between the kernel and SDPA, each step filed under the setting its forward ran with."""
    if not linear_supports(torch.float32):
        pytest.skip("the C++ decoder stack is not built for this CPU")
    model = make_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "invariance.json"
    assert main(["bench", "concurrency", "--model", str(model), "--dtype", "float32", "--compare",
                 "batch-invariance", "--num-prompts", "6", "--max-concurrency", "3",
                 "--max-tokens", "16", "--period", "0.005", "--ignore-eos", "--json", str(out)]) == 0
    assert "batch-invariance switched" in capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]["all_steps"]
    assert run["off"]["steps"] > 0 and run["on"]["steps"] > 0
    assert run["off"]["tokens"] + run["on"]["tokens"] == 6 * 16
    assert run["on"]["draft_slots"] == 0
