"""draft_model, eagle and eagle3 through the real services.

Tiny random targets and drafts written to disk in the published layouts, loaded by the
real loaders, served by a real drafter gRPC server to a real verifier engine. Greedy
output with each method equals plain decoding's; a draft model identical to the target
has every draft accepted, which only holds while the drafter's state stays in step with
the verifier's through chunked prefill, batching and rollback.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import torch

from specdec.engine.sampling_params import SamplingParams
from specdec.models.cpu_stack import CPU_STACK_ENV
from tests.support.draft_checkpoints import make_draft_model, make_eagle3_head, make_eagle_head
from tests.support.model_drafting import MAX_TOKENS, NUM_LAYERS, PROMPTS, K, serve_and_generate
from tests.support.tiny_models import make_tiny_llama
from specdec.engine.engine import Engine


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def plain(target: Path, device) -> list[list[int]]:
    outputs, _ = asyncio.run(serve_and_generate(target, str(device), None))
    return outputs


def draft_spec(method: str, model: Path) -> dict:
    return {"method": method, "model": str(model), "num_speculative_tokens": K}


async def test_identical_draft_model_has_every_draft_accepted(target, device, plain) -> None:
    outputs, engine = await serve_and_generate(target, str(device),
                                               draft_spec("draft_model", target))
    assert outputs == plain
    assert engine.spec.num_draft_tokens > 0
    assert engine.spec.num_accepted_tokens == engine.spec.num_draft_tokens


async def test_wrong_draft_model_still_gives_the_target_output(target, device, plain,
                                                               tmp_path) -> None:
    wrong = make_draft_model(tmp_path / "wrong", num_layers=1, seed=7)
    outputs, engine = await serve_and_generate(target, str(device), draft_spec("draft_model", wrong))
    assert outputs == plain
    assert engine.spec.num_draft_tokens > 0
    assert engine.spec.num_accepted_tokens < engine.spec.num_draft_tokens


async def test_mismatched_vocabulary_is_refused_and_serving_goes_on(
        target, device, plain, tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    other = make_tiny_llama(tmp_path / "other-vocab", vocab_size=80)
    caplog.set_level(logging.ERROR)
    outputs, engine = await serve_and_generate(target, str(device), draft_spec("draft_model", other),
                                               expect_healthy=False)
    assert outputs == plain
    assert engine.spec.num_drafts == 0
    assert "vocab_size is 80" in caplog.text


@pytest.mark.parametrize("fc_bias,with_embed,weights_format", [
    (False, False, "bin"),
    (True, False, "safetensors"),
    (True, True, "bin"),
])
async def test_eagle_greedy_invariance(target, device, plain, tmp_path, fc_bias, with_embed,
                                       weights_format) -> None:
    head = tmp_path / "eagle"
    make_eagle_head(head, target, fc_bias=fc_bias, with_embed=with_embed,
                    weights_format=weights_format)
    outputs, engine = await serve_and_generate(target, str(device), draft_spec("eagle", head))
    assert outputs == plain
    assert engine.spec.num_draft_tokens > 0


@pytest.mark.parametrize("draft_vocab_size,layer_ids", [
    (None, None),
    (40, None),
    (40, [1, 3, 6]),
])
async def test_eagle3_greedy_invariance(target, device, plain, tmp_path, draft_vocab_size,
                                        layer_ids) -> None:
    head = tmp_path / "eagle3"
    make_eagle3_head(head, target, draft_vocab_size=draft_vocab_size, layer_ids=layer_ids)
    outputs, engine = await serve_and_generate(target, str(device), draft_spec("eagle3", head))
    assert outputs == plain
    assert engine.spec.num_draft_tokens > 0
    # EAGLE-3's layer ids name the residual stream entering a layer, as the verifier's do.
    expected_layers = tuple(layer_ids) if layer_ids else (2, 4, 5)
    assert engine.drafter_pool.hidden_state_layer_ids == expected_layers


async def test_eagle3_with_a_compiled_verifier(target, device, plain, tmp_path, monkeypatch) -> None:
    """--compile builds the graph for the head's target layers at start-up: the requests
    compile nothing, and the output is still the target's."""
    if str(device) != "cpu":
        pytest.skip("--compile is tested on the cpu")
    monkeypatch.setenv(CPU_STACK_ENV, "0")  # the CPU verifier would run the C++ decoder stack
    head = tmp_path / "eagle3"
    make_eagle3_head(head, target, draft_vocab_size=40, layer_ids=[1, 3, 6])
    counters = torch._dynamo.utils.counters
    graphs_at_start: list[int] = []
    start = Engine.start

    async def start_and_count(engine: Engine) -> None:  # built, warmed up, no request yet
        graphs_at_start.append(counters["stats"]["unique_graphs"])
        await start(engine)

    monkeypatch.setattr(Engine, "start", start_and_count)
    outputs, engine = await serve_and_generate(target, str(device), draft_spec("eagle3", head),
                                               compile_forward=True)
    assert outputs == plain
    assert engine.spec.num_draft_tokens > 0
    assert counters["stats"]["unique_graphs"] == graphs_at_start[0], "a request compiled a graph"


async def test_a_token_map_cuts_the_draft_vocabulary_not_the_output(target, device, plain, tmp_path) -> None:
    """With the target as its own draft every draft is accepted; cut to a token map that
    holds every token plain decoding writes, still every one; cut to a map missing some of
    them, those drafts fail (a full head would have proposed them) and the output stays the
    target's."""
    written = sorted({token for output in plain for token in output})
    covering = tmp_path / "covering.json"
    covering.write_text(json.dumps(written + [0, 1]))
    outputs, engine = await serve_and_generate(
        target, str(device), {**draft_spec("draft_model", target), "speculative_token_map": str(covering)})
    assert outputs == plain
    assert 0 < engine.spec.num_accepted_tokens == engine.spec.num_draft_tokens
    missing = tmp_path / "missing.txt"
    missing.write_text(" ".join(str(token) for token in written[::2]))
    outputs, engine = await serve_and_generate(
        target, str(device), {**draft_spec("draft_model", target), "speculative_token_map": str(missing)})
    assert outputs == plain
    assert 0 < engine.spec.num_accepted_tokens < engine.spec.num_draft_tokens
    head = tmp_path / "eagle"
    make_eagle_head(head, target, fc_bias=False, with_embed=False, weights_format="safetensors")
    outputs, engine = await serve_and_generate(
        target, str(device), {**draft_spec("eagle", head), "speculative_token_map": str(covering)})
    assert outputs == plain
    assert engine.spec.num_draft_tokens > 0


@pytest.mark.parametrize("with_token_map", [False, True], ids=["full-head", "token-map"])
async def test_probabilistic_drafting_is_seeded_and_complete(target, device, tmp_path, with_token_map) -> None:
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = draft_spec("draft_model", target)
    if with_token_map:  # sampled drafts' probabilities come back over the target's vocabulary
        token_map = tmp_path / "map.json"
        token_map.write_text(json.dumps(list(range(0, 96, 2))))
        spec["speculative_token_map"] = str(token_map)
    first, engine = await serve_and_generate(target, str(device), spec, params, draft_sampling=True)
    second, _ = await serve_and_generate(target, str(device), spec, params, draft_sampling=True)
    assert all(len(tokens) == MAX_TOKENS for tokens in first)
    assert first == second
    assert 0 < engine.spec.num_accepted_tokens <= engine.spec.num_draft_tokens


def test_launcher_passes_the_speculation_through_to_the_drafter(target, plain, tmp_path) -> None:
    """`python -m specdec serve` with an EAGLE-3 head on a local model: the drafter gets the
    config and the target, drafts arrive, and the answers are the target's."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    from tests.support.tiny_models import make_tokenizer

    head = tmp_path / "eagle3"
    make_eagle3_head(head, target, draft_vocab_size=40, layer_ids=None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    spec = json.dumps(draft_spec("eagle3", head))
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec", "serve", "--model", str(target), "--port", str(port),
         "--speculative-config", spec, "--max-model-len", "128", "--block-size", "4",
         "--num-gpu-blocks-override", "256", "--dtype", "float32", "--enforce-eager",
         "--log-level", "warning"],
        cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "the launcher exited"
            assert time.monotonic() < deadline, "not healthy in 120 s"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        tokenizer = make_tokenizer(96)
        num_draft_tokens = []
        for prompt, expected in zip(PROMPTS, plain):
            response = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": str(target), "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
            body = response.json()
            words = tokenizer.decode(expected, skip_special_tokens=True).split()
            assert body["choices"][0]["text"].split() == words
            num_draft_tokens.append(
                body["usage"].get("speculation", {}).get("num_draft_tokens", 0))
        # The launcher's verifier serves only once its drafter is connected: the very first
        # request is speculated.
        assert num_draft_tokens[0] > 0, num_draft_tokens
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
