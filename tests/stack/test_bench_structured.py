"""`bench structured` on a tiny model: grammars compile, requests finish, figures come out
(no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.__main__ import main
from specdec.bench.serve_requests import load_requests
from specdec.bench.structured import METHODS, grammar_of, tool_call_schema
from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model
from tests.support.grammar_decode import make_padded_tiny_model


def test_agent_tool_schema_names_every_tool() -> None:
    request = load_requests("agent", 1)[0]
    schema = tool_call_schema(request.messages[0]["content"])
    names = [option["properties"]["name"]["const"] for option in schema["anyOf"]]
    assert len(names) == len(set(names)) >= 4
    kind, value = grammar_of(load_requests("extract", 1)[0], "extract")
    assert kind == "json_schema" and json.loads(value)["type"] == "object"


def test_the_shipped_drafts_are_methods() -> None:
    for name in ("eagle3", "draft_model"):
        assert METHODS[name]["method"] == name
        assert (resolve_model(METHODS[name]["model"]) / "config.json").is_file()


def test_runs_and_reports(tmp_path: Path, capsys) -> None:
    # The default model's tokenizer (llguidance reads it), a tiny random model.
    model = tmp_path / "tiny"
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    make_padded_tiny_model(tokenizer.eos_token_id).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "structured.json"
    assert main(["bench", "structured", "--model", str(model), "--dtype", "float32",
                 "--enforce-eager", "--max-model-len", "1024", "--methods", "ngram",
                 "--workloads", "extract", "--num-prompts", "2", "--max-concurrency", "2",
                 "--max-tokens", "8", "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(row["method"], row["workload"], row["concurrency"]) for row in rows] == [
        ("ngram", "extract", 2)]
    assert rows[0]["off_tokens_per_s"] > 0 and rows[0]["on_tokens_per_s"] > 0
    assert rows[0]["tokens_per_step"] > 0 and rows[0]["accepted_per_draft"] >= 0
    assert "tok/s" in capsys.readouterr().out
