"""`bench prefix-cache` runs its three measurements on a tiny model (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.__main__ import main
from tests.support.tiny_models import make_tiny_llama


def test_runs_and_reports_every_part(tmp_path: Path, capsys) -> None:
    model = make_tiny_llama(tmp_path / "tiny", max_positions=512)
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix-cache", "--model", str(model), "--dtype", "float32",
                 "--enforce-eager", "--max-model-len", "512", "--system-tokens", "96",
                 "--ttft-requests", "2", "--num-prompts", "4", "--max-concurrency", "2",
                 "--max-tokens", "4", "--rounds", "1", "--batch-sizes", "1,2",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "chat with a shared system prompt" in printed
    figures = json.loads(out.read_text())
    ttft = figures["ttft"]
    assert ttft["prompt_tokens"] >= 96
    # The repeated system prompt came from the cache with caching on, never with it off.
    assert ttft["cached_tokens_on"] >= 64 and ttft["cached_tokens_off"] == 0
    assert figures["throughput"]["requests"] == 4
    assert [row["batch_size"] for row in figures["logprobs"]] == [1, 2]
    for row in figures["logprobs"]:
        assert row["step_ms_with"] > 0 and row["step_ms_without"] > 0
