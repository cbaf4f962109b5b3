"""vLLM's --seed: the server's default random stream, for the requests that bring no seed
of their own; a request's own seed and greedy decoding are untouched by it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specdec import launcher
from specdec.config_flags import build_config
from specdec.engine.sampling_params import SamplingParams
from tests.support.engine_harness import generate, served_engine
from tests.support.tiny_models import make_tiny_llama
from verifier_svc import __main__ as verifier_main
from verifier_svc.builder import VerifierConfig

PROMPT = [5, 9, 2, 7, 11]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-seed"))


def test_seed_is_an_engine_flag_the_launcher_passes_to_its_verifier() -> None:
    parser = verifier_main.build_parser()
    assert build_config(VerifierConfig, parser.parse_args([])).engine.seed is None
    assert build_config(VerifierConfig, parser.parse_args(["--seed", "7"])).engine.seed == 7
    serve = argparse.ArgumentParser()
    launcher.add_serve_args(serve)
    commands = dict(launcher._child_commands(serve.parse_args(["--seed", "7"]), "/models/m"))
    assert commands["verifier"][commands["verifier"].index("--seed") + 1] == "7"
    assert "--seed" not in commands["gateway"]
    assert "--seed" not in dict(launcher._child_commands(serve.parse_args([]), "/m"))["verifier"]


async def answers(model: Path, server_seed: int) -> tuple[list[int], list[int], list[int]]:
    """An unseeded sampled answer, a seeded one and a greedy one from a fresh server."""
    async with served_engine(model, None, "cpu", seed=server_seed, max_model_len=64,
                             num_kv_blocks=64) as engine:
        unseeded = await generate(engine, PROMPT, SAMPLED)
        seeded = await generate(engine, PROMPT, SamplingParams(
            temperature=1.0, max_tokens=12, ignore_eos=True, seed=3))
        greedy = await generate(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=12,
                                                               ignore_eos=True))
    return unseeded, seeded, greedy


async def test_a_server_seed_repeats_the_unseeded_answers_of_a_restart(tiny_model: Path) -> None:
    first = await answers(tiny_model, server_seed=11)
    assert await answers(tiny_model, server_seed=11) == first
    other = await answers(tiny_model, server_seed=12)
    # Another server seed, another unseeded stream; a request's own seed and greedy
    # decoding do not depend on it.
    assert other[0] != first[0]
    assert other[1:] == first[1:]
