"""`python -m specdec bench replay`: its counts against a hand count, and specdec's suffix
proposer against the reference's figures recorded for the synthetic streams (issue 48,
item 1; tests/data/suffix_replay_reference.json, written by `--save-reference` where
arctic-inference is installed, so CI needs no arctic-inference)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from specdec.bench import replay as bench_replay
from specdec.bench.replay import compare, replay
from specdec.bench.replay_stream import StreamRequest, load_stream, save_stream
from specdec.bench.replay_proposers import ReplayDraft, SpecdecSuffix, SuffixSettings
from specdec.bench.replay_synthetic import synthetic_streams

REFERENCE = Path(__file__).parents[1] / "data" / "suffix_replay_reference.json"


class ScriptedProposer:
    """Drafts a fixed list per call and records what it was asked and told."""

    name = "scripted"

    def __init__(self, drafts: list[ReplayDraft]) -> None:
        self.drafts = drafts
        self.asked: list[int] = []
        self.extended: list[list[int]] = []
        self.events: list[str] = []

    def start(self, request_id: int, prompt_ids: Sequence[int]) -> None:
        self.events.append(f"start {request_id} {list(prompt_ids)}")

    def propose(self, max_tokens: int) -> ReplayDraft:
        self.asked.append(max_tokens)
        return self.drafts.pop(0)

    def extend(self, token_ids: Sequence[int]) -> None:
        self.extended.append(list(token_ids))

    def finish(self) -> None:
        self.events.append("finish")


def test_counts_equal_a_hand_count() -> None:
    stream = [StreamRequest([1, 2], [10, 11, 12, 13, 14, 15])]
    proposer = ScriptedProposer([ReplayDraft([11, 12, 99]), ReplayDraft([14, 15])])
    counts = replay(stream, proposer, num_speculative_tokens=3)
    # Step 1: the prefill yields 10. Step 2: at most min(3, 6 - 1 - 1) = 3 tokens; 11 and 12
    # accepted, 99 wasted; the target's 13 follows. Step 3: one answer token is left after
    # the target's own, so the draft is cut to [14]: accepted, and the target's 15 ends it.
    assert proposer.asked == [3, 1]
    assert proposer.extended == [[10], [11, 12, 13], [14, 15]]
    assert proposer.events == ["start 0 [1, 2]", "finish"]
    assert counts.summary() | {"ms_per_step": 0} == {
        "requests": 1, "tokens": 6, "steps": 3, "tokens_per_step": 2.0, "drafted_rows": 4,
        "wasted_rows": 1, "ms_per_step": 0}


def test_tree_counts_equal_a_hand_count() -> None:
    stream = [StreamRequest([1, 2], [10, 11, 12, 13, 14, 15])]
    # Step 2: root children 99 and 11; 11's child 12, 99's child 12. Accepted: 11, 12 (the
    # second branch), 4 rows drafted; the target's 13 follows. Step 3: [14] as a tree of one.
    proposer = ScriptedProposer([ReplayDraft([99, 11, 12, 12], [-1, -1, 0, 1]),
                                 ReplayDraft([14, 77], [-1, -1])])
    counts = replay(stream, proposer, num_speculative_tokens=4)
    assert proposer.extended == [[10], [11, 12, 13], [14, 15]]
    assert counts.summary() | {"ms_per_step": 0} == {
        "requests": 1, "tokens": 6, "steps": 3, "tokens_per_step": 2.0, "drafted_rows": 5,
        "wasted_rows": 2, "ms_per_step": 0}


def test_specdecs_suffix_proposer_by_hand() -> None:
    stream = [StreamRequest([10, 11, 12, 13], [10, 11, 12, 13, 14]),
              StreamRequest([50, 51], [10, 11, 12, 13, 14])]
    counts = replay(stream, SpecdecSuffix(SuffixSettings(8)), 8)
    # Request 0: after the prefill's 10, "10" matched once in the prompt: a draft of
    # match-length x 1.0 = 1 token, [11], accepted (+12); then "10 11 12" drafts [13], the
    # one token left room for, accepted (+14): 3 steps, 2 rows, none wasted.
    # Request 1 (its prompt shows none of it) drafts the same from request 0's answer.
    assert counts.summary() | {"ms_per_step": 0} == {
        "requests": 2, "tokens": 10, "steps": 6, "tokens_per_step": round(10 / 6, 4),
        "drafted_rows": 4, "wasted_rows": 0, "ms_per_step": 0}


def test_a_stream_file_round_trips_and_a_bad_line_is_named(tmp_path: Path) -> None:
    stream = [StreamRequest([1, 2, 3], [4, 5]), StreamRequest([6], [7, 8, 9])]
    path = tmp_path / "stream.jsonl"
    save_stream(stream, path)
    assert load_stream(path) == stream
    path.write_text('{"prompt_ids": [1], "answer_ids": [2]}\n{"prompt_ids": [1]}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_stream(path)


def test_the_command_prints_and_writes_the_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stream = [StreamRequest([10, 11, 12, 13], [10, 11, 12, 13, 14])]
    path = tmp_path / "tiny.jsonl"
    save_stream(stream, path)
    out = tmp_path / "rows.json"
    assert bench_replay.main(["--stream", str(path), "--num-speculative-tokens", "8",
                              "--no-reference", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows == [{"stream": "tiny", "k": 8, "proposer": "specdec",
                     **replay(stream, SpecdecSuffix(SuffixSettings(8)), 8).summary(),
                     "ms_per_step": rows[0]["ms_per_step"]}]
    assert "tiny" in capsys.readouterr().out


def test_specdec_drafts_at_least_as_well_as_the_recorded_reference() -> None:
    recorded = json.loads(REFERENCE.read_text())
    reference = {(row["stream"], row["k"]): row for row in recorded["rows"]}
    ks = sorted({k for _, k in reference})
    streams = synthetic_streams()
    assert set(streams) == {stream for stream, _ in reference} and ks == [8, 24]
    rows = compare(streams, ks, {"specdec": SpecdecSuffix})
    assert len(rows) == len(reference)
    for row in rows:
        theirs = reference[(row["stream"], row["k"])]
        assert row["tokens"] == theirs["tokens"]  # the same stream
        assert row["tokens_per_step"] >= theirs["tokens_per_step"], row
        assert row["wasted_rows"] <= theirs["wasted_rows"], row
