"""Flags derived from the services' typed configs (specdec.config_flags): one definition
gives the flag, its default and choices in --help, the config back from argv, and the argv
that gives a child process the same config."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from drafter_svc.proposer import ModelOptions
from drafter_svc.sequence_table import StreamLimits
from gateway import __main__ as gateway_main
from gateway.config import GatewayConfig
from specdec.cli import DEFAULT_PORTS, DefaultsHelpFormatter
from specdec.config import LOGPROBS_MODES, EngineConfig, SpeculativeConfig
from specdec.config_flags import add_config_args, build_config, config_argv
from specdec.grammar_checker import GrammarLimits
from verifier_svc import __main__ as verifier_main
from verifier_svc.builder import VerifierConfig


def parser_for(*config_types: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    for config_type in config_types:
        add_config_args(parser, config_type)
    return parser


def test_help_shows_each_field_default_and_choices() -> None:
    text = " ".join(parser_for(VerifierConfig).format_help().split())
    assert "--max-num-seqs MAX_NUM_SEQS requests running at once (default: 256)" in text
    assert "--logprobs-mode {" + ",".join(LOGPROBS_MODES) + "}" in text
    assert "--speculation-policy {adaptive,fixed}" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text
    # Nested configs give their flags too: the grammar limits inside the verifier's.
    assert "--max-grammar-chars MAX_GRAMMAR_CHARS" in text
    assert f"(default: {GrammarLimits().max_chars})" in text


def test_defaults_build_the_default_config() -> None:
    args = parser_for(VerifierConfig).parse_args([])
    assert build_config(VerifierConfig, args) == VerifierConfig()
    args = parser_for(ModelOptions, StreamLimits).parse_args([])
    assert build_config(ModelOptions, args) == ModelOptions()
    assert build_config(StreamLimits, args) == StreamLimits()


def test_a_flag_reaches_its_nested_field_converted() -> None:
    args = parser_for(VerifierConfig).parse_args([
        "--draft-timeout-ms", "40", "--speculation-policy", "fixed",
        "--no-enable-prefix-caching", "--num-gpu-blocks-override", "12",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
        "--drafter", "a:1", "--drafter", "b:2", "--grammar-compile-workers", "3"])
    config = build_config(VerifierConfig, args)
    assert config.engine == dataclasses.replace(
        EngineConfig(), draft_timeout_s=0.04, adaptive_speculation=False,
        enable_prefix_caching=False, num_kv_blocks=12)
    assert config.speculative_config == SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 2}')
    assert config.drafter_targets == ("a:1", "b:2")
    assert config.grammar_limits.compile_workers == 3
    # The namespace keeps the flag's own name and unit.
    assert args.draft_timeout_ms == 40 and args.num_gpu_blocks_override == 12


def test_argv_rebuilds_the_same_config() -> None:
    """What the launcher relies on: a child parsing config_argv(config) holds config."""
    config = build_config(
        VerifierConfig, model="/models/m", max_model_len=64, draft_timeout_s=0.03,
        adaptive_speculation=False, enable_prefix_caching=False,
        logprobs_mode="processed_logprobs", drafter_targets=("127.0.0.1:5",),
        speculative_config=SpeculativeConfig.parse('{"method": "suffix"}'),
        grammar_limits=GrammarLimits(max_chars=100), enforce_eager=True)
    argv = config_argv(config)
    assert build_config(VerifierConfig, verifier_main.build_parser().parse_args(argv)) == config
    # Only what differs from the child's defaults is written.
    assert config_argv(VerifierConfig()) == []
    gateway = GatewayConfig(model="m", verifier_addresses=("v:1", "v:2"),
                            tool_call_parser="hermes", enable_auto_tool_choice=True)
    parsed = gateway_main.build_parser().parse_args(config_argv(gateway))
    assert build_config(GatewayConfig, parsed) == gateway


def test_a_required_field_is_a_required_flag() -> None:
    with pytest.raises(SystemExit):
        gateway_main.build_parser().parse_args(["--model", "m"])  # no --verifier
    with pytest.raises(SystemExit):
        gateway_main.build_parser().parse_args(["--verifier", "v:1"])  # no --model


def test_build_config_refuses_a_name_no_config_holds() -> None:
    with pytest.raises(TypeError, match="num_gpu_blocks"):
        build_config(VerifierConfig, num_gpu_blocks=3)


def test_each_role_listens_on_its_own_default_port() -> None:
    from drafter_svc.server import build_arg_parser

    gateway = gateway_main.build_parser().parse_args(["--model", "m", "--verifier", "v:1"])
    assert build_config(GatewayConfig, gateway).port == DEFAULT_PORTS["gateway"]
    assert verifier_main.build_parser().parse_args([]).port == DEFAULT_PORTS["verifier"]
    drafter = build_arg_parser().parse_args(["--speculative-config", "{}"])
    assert drafter.port == DEFAULT_PORTS["drafter"]


def test_environment_variables_are_the_defaults_of_config_fields(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("SPECDEC_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("SPECDEC_CPU_STACK", raising=False)
    config = VerifierConfig()
    assert (config.cpu_kv_cache_space_gib, config.attention_backend, config.cpu_stack) == (
        4.0, "auto", True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1.5")
    monkeypatch.setenv("SPECDEC_ATTENTION_BACKEND", "Torch")
    monkeypatch.setenv("SPECDEC_CPU_STACK", "0")
    config = VerifierConfig()
    assert (config.cpu_kv_cache_space_gib, config.attention_backend, config.cpu_stack) == (
        1.5, "torch", False)
    # A field set in code wins over the environment.
    assert VerifierConfig(attention_backend="cpu").attention_backend == "cpu"
