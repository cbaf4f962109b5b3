"""`python -m specdec bench compare` on the tiny model: every row, figures, identity checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.bench import compare as bench_compare
from specdec.bench import compare_build
from specdec.bench.compare_report import same_output, summarise
from specdec.bench.compare_systems import (
    Generation,
    load_assistant,
    load_transformers_model,
    strip_stop,
)
from specdec.bench.llama_cpp_system import llama_cpp_installed
from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from tests.support.draft_checkpoints import make_draft_model
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.speculation import probe_schedule

NGRAM = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
         '"prompt_lookup_max": 3}')
SYSTEMS = ["specdec", "specdec-ngram", "transformers", "transformers-prompt-lookup"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("compare") / "target")


def test_compare_rows_figures_and_identity(tiny_model: Path, tmp_path: Path, capsys,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Probes wait out their back-off only (no wait priced beyond it): the tiny model's step is
    # cheaper than a drafter round trip, so speculation never pays and only probes would
    # draft, which the test needs.
    monkeypatch.setattr(probe_schedule, "MAX_PROBE_INTERVAL", 1)  # no priced wait
    output = tmp_path / "compare.json"
    code = bench_compare.main([
        "--model", str(tiny_model), "--dtype", "float32", "--max-tokens", "24", "--repeats", "2",
        "--prompt", "repeat", "--prompt", "open", "--speculative-config", NGRAM,
        "--systems", ",".join(SYSTEMS), "--systems", "llama.cpp", "--threads", "1",
        "--disable-tqdm", "--json", str(output)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(output.read_text())
    assert report["threads"] == 1 and report["dtype"] == "float32"
    rows = {(row["prompt"], row["system"]): row for row in report["rows"]}
    assert set(rows) == {(prompt, system) for prompt in ("repeat", "open") for system in SYSTEMS}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["output_tokens"] > 0
        assert row["vs_specdec"] > 0 and row["vs_transformers"] > 0
    for prompt in ("repeat", "open"):
        assert rows[(prompt, "specdec")]["vs_specdec"] == 1.0
        assert rows[(prompt, "transformers")]["vs_transformers"] == 1.0
        # Greedy fp32: speculation changes no token, and plain is deterministic.
        assert rows[(prompt, "specdec")]["identical_to_specdec"] is True
        assert rows[(prompt, "specdec-ngram")]["identical_to_specdec"] is True
        assert rows[(prompt, "specdec-ngram")]["mean_acceptance_length"] >= 1.0
        assert rows[(prompt, "transformers")]["compared_by"] == "token ids"
    # The tiny model has no GGUF; without llama-cpp-python the row says so.
    (skipped,) = report["skipped"]
    assert skipped["name"] == "llama.cpp"
    expected = "not installed" if not llama_cpp_installed() else "no GGUF file"
    assert expected in skipped["reason"]
    for system in SYSTEMS:
        assert system in printed
    assert f"skipped: {skipped['reason']}" in printed
    header = next(line for line in printed.splitlines() if line.startswith("prompt"))
    for column in ("tok/s", "vs specdec", "vs transformers", "identical to specdec"):
        assert column in header


def test_system_names_and_selection() -> None:
    specs = [SpeculativeConfig.parse(NGRAM), SpeculativeConfig.parse(NGRAM),
             SpeculativeConfig.parse('{"method": "draft_model", "num_speculative_tokens": 2, '
                                     '"model": "/d"}')]
    names = list(compare_build.system_names(specs))
    assert names == ["specdec", "specdec-ngram", "specdec-ngram-2", "specdec-draft_model",
                     "transformers", "transformers-prompt-lookup", "transformers-assisted",
                     "llama.cpp", "llama.cpp-prompt-lookup"]
    assert bench_compare.select(names, None) == names
    assert bench_compare.select(names, ["llama.cpp*", "specdec"]) == [
        "specdec", "llama.cpp", "llama.cpp-prompt-lookup"]
    with pytest.raises(ConfigError, match="no system matches 'vllm'"):
        bench_compare.select(names, ["specdec,vllm"])


@pytest.mark.parametrize("run,reference,expected", [
    (Generation([5, 6, 7], "a b c", 3, 1.0), Generation([5, 6, 7], "a b c", 3, 1.0), (True, None)),
    (Generation([5, 6, 8], "a b d", 3, 1.0), Generation([5, 6, 7], "a b c", 3, 1.0), (False, 2)),
    (Generation([5, 6], "a b", 2, 1.0), Generation([5, 6, 7], "a b c", 3, 1.0), (False, 2)),
    # llama.cpp has text only: compared by text, whitespace at the ends ignored.
    (Generation(None, " a b c\n", 3, 1.0), Generation([5, 6, 7], "a b c", 3, 1.0), (True, None)),
    (Generation(None, "a b x", 3, 1.0), Generation([5, 6, 7], "a b c", 3, 1.0), (False, None)),
])
def test_identity_check(run: Generation, reference: Generation, expected: tuple) -> None:
    assert same_output(run, reference) == expected


def test_summary_ratios() -> None:
    results = {"p": {"specdec": [Generation([1], "", 10, 1.0), Generation([1], "", 10, 0.5)],
                     "transformers": [Generation([1], "", 10, 2.0)],
                     "llama.cpp": [Generation(None, "x", 10, 0.25)]}}
    kinds = {"specdec": "specdec", "transformers": "transformers", "llama.cpp": "llama.cpp"}
    rows = {row["system"]: row for row in summarise(results, kinds)}
    assert rows["specdec"]["tokens_per_s"] == 15.0  # median of 10 and 20
    assert rows["transformers"]["vs_specdec"] == round(5 / 15, 3)
    assert rows["llama.cpp"]["vs_transformers"] == 8.0
    assert rows["llama.cpp"]["identical_to_specdec"] is False
    assert rows["llama.cpp"]["compared_by"] == "text"


def test_ratios_pair_the_runs_of_each_repeat() -> None:
    """The machine's phase changes between runs: ngram runs at 0.9x specdec in the first and
    third repeats, and in the second it ran after a speed-up that specdec's run missed. The
    ratio is the median of the repeats' (0.9x), where the medians' would be 27 / 10."""
    tokens_per_s = {"specdec": [30.0, 10.0, 10.0], "specdec-ngram": [27.0, 27.0, 9.0]}
    results = {"p": {name: [Generation([1], "", 30, 30 / value) for value in values]
                     for name, values in tokens_per_s.items()}}
    rows = {row["system"]: row for row in summarise(results, dict.fromkeys(tokens_per_s, "specdec"))}
    assert rows["specdec-ngram"]["tokens_per_s"] == 27.0 and rows["specdec"]["tokens_per_s"] == 10.0
    assert rows["specdec-ngram"]["vs_specdec"] == 0.9


def test_strip_stop() -> None:
    assert strip_stop([4, 5, 2, 9], {2}) == [4, 5]
    assert strip_stop([4, 5], {2}) == [4, 5]


def test_assistant_without_embeddings_borrows_the_targets(tiny_model: Path,
                                                          tmp_path: Path) -> None:
    draft = make_draft_model(tmp_path / "draft", num_layers=1, seed=3)
    tensors = load_file(str(draft / "model.safetensors"))
    kept = {name: t for name, t in tensors.items()
            if "embed_tokens" not in name and "lm_head" not in name}
    assert len(kept) < len(tensors)
    save_file(kept, str(draft / "model.safetensors"), metadata={"format": "pt"})
    target = load_transformers_model(tiny_model, "float32", "cpu")
    assistant = load_assistant(draft, target)
    assert torch.equal(assistant.get_input_embeddings().weight,
                       target.get_input_embeddings().weight)
    assert torch.equal(assistant.get_output_embeddings().weight,
                       target.get_output_embeddings().weight)


def test_shipped_drafts_by_name(monkeypatch, tmp_path: Path) -> None:
    drafts = pytest.importorskip("specdec.drafts")
    present = {"tiny-eagle3": tmp_path / "tiny-eagle3", "tiny-draft": tmp_path / "tiny-draft"}
    monkeypatch.setattr(drafts, "SHIPPED_DRAFTS", {"tiny-eagle3": "eagle3", "absent": "eagle",
                                                   "tiny-draft": "draft_model"})
    monkeypatch.setattr(drafts, "shipped_draft_dir", present.get)
    configs = bench_compare.shipped_draft_configs(num_speculative_tokens=2)
    assert [(c.method, c.model, c.num_speculative_tokens, c.speculative_token_map) for c in configs] == [
        ("eagle3", "tiny-eagle3", 2, None),  # its own reduced vocabulary
        ("draft_model", "tiny-draft", 2, drafts.SHIPPED_TOKEN_MAP)]
    monkeypatch.setattr(drafts, "shipped_draft_dir", lambda name: None)
    assert bench_compare.shipped_draft_configs() == []  # none shipped: ngram only


def test_routed_from_the_command_line(capsys) -> None:
    from specdec.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "compare", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    for flag in ("--model", "--dtype", "--max-tokens", "--repeats", "--systems", "--json",
                 "--threads", "--speculative-config"):
        assert flag in printed, flag


def test_quantization_reaches_specdecs_engines_and_llama_cpps_precision(
        tiny_model: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.bench import compare_systems as bench_compare_systems

    built = []

    def recording_build_engine(config):
        built.append(config.quantization)
        return build_engine(config)

    build_engine = bench_compare_systems.build_engine
    monkeypatch.setattr(bench_compare_systems, "build_engine", recording_build_engine)
    output = tmp_path / "compare.json"
    code = bench_compare.main([
        "--model", str(tiny_model), "--dtype", "bfloat16", "--quantization", "int8", "--max-tokens", "8",
        "--repeats", "1", "--prompt", "repeat", "--speculative-config", NGRAM,
        "--systems", "specdec,specdec-ngram", "--threads", "1", "--disable-tqdm", "--json", str(output)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert built == ["int8"]  # plain runs on the ngram engine with k = 0
    report = json.loads(output.read_text())
    assert report["quantization"] == "int8" and "bfloat16 (weight-only int8)" in printed
    assert {row["system"] for row in report["rows"]} == {"specdec", "specdec-ngram"}
    # llama.cpp's like-for-like precision: Q8_0 beside weight-only int8.
    args = bench_compare.build_parser().parse_args(["--dtype", "bfloat16", "--quantization", "int8"])
    assert compare_build.llama_cpp_precision(args) == "Q8_0"
    args = bench_compare.build_parser().parse_args(["--dtype", "float32"])
    assert compare_build.llama_cpp_precision(args) == "F32"
