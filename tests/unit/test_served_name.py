"""One rule names the served model (specdec.cli.served_model_name): --served-model-name,
else --model as given with a path named by its last component. The gateway's API and
metrics, the verifier and the launcher's children all use it, so no label shows a path."""

from __future__ import annotations

import argparse

from prometheus_client import generate_latest

from gateway.config import GatewayConfig
from gateway.generation import GenerationResult
from gateway.metrics import GatewayMetrics
from specdec import launcher
from specdec.cli import served_model_name
from specdec.v1 import specdec_pb2

MODEL_PATH = "/srv/models/SmolLM2-135M/"


def gateway_config(model: str, served: str | None = None) -> GatewayConfig:
    return GatewayConfig(model=model, served_model_name=served,
                         verifier_addresses=("127.0.0.1:50051",))


def test_the_gateway_names_a_path_model_by_its_last_component() -> None:
    assert gateway_config(MODEL_PATH).model_name == "SmolLM2-135M" == served_model_name(MODEL_PATH)
    assert gateway_config("/srv/models/smol-q4.gguf").model_name == "smol-q4"
    assert gateway_config("smollm2-135m-instruct").model_name == "smollm2-135m-instruct"
    assert gateway_config(MODEL_PATH, "chosen").model_name == "chosen"


def test_the_gateways_metrics_label_never_shows_a_path() -> None:
    metrics = GatewayMetrics(gateway_config(MODEL_PATH).model_name)
    result = GenerationResult(num_prompt_tokens=3, num_completion_tokens=2,
                              speculation=specdec_pb2.SpeculationStats(num_drafts=1))
    metrics.observe_generation(result)
    exported = generate_latest(metrics.registry).decode()
    assert 'model_name="SmolLM2-135M"' in exported
    assert "/srv/models" not in exported


def test_the_launcher_gives_its_children_one_served_name() -> None:
    parser = argparse.ArgumentParser()
    launcher.add_serve_args(parser)
    for flags, expected in (([], "SmolLM2-135M"), (["--served-model-name", "chosen"], "chosen")):
        args = parser.parse_args(["--model", MODEL_PATH, "--verifier-port", "50051", *flags])
        commands = dict(launcher._child_commands(args, "/resolved/snapshot"))
        for child in ("verifier", "gateway"):
            argv = commands[child]
            assert argv[argv.index("--served-model-name") + 1] == expected, child


def test_requests_may_name_the_model_as_vllm_would() -> None:
    """vLLM's name for a path model is the path as given: a client moving from it may send
    that, and the gateway accepts it beside the served name (it lists only the latter)."""
    config = gateway_config(MODEL_PATH)
    assert config.names_model("SmolLM2-135M") and config.names_model(MODEL_PATH)
    assert not config.names_model("other") and not config.names_model("/srv/models")
    launched = GatewayConfig(model="/resolved/snapshot", served_model_name="SmolLM2-135M",
                             model_alias=MODEL_PATH, verifier_addresses=("127.0.0.1:50051",))
    assert launched.names_model(MODEL_PATH) and not launched.names_model("/resolved/snapshot")
    parser = argparse.ArgumentParser()
    launcher.add_serve_args(parser)
    args = parser.parse_args(["--model", MODEL_PATH, "--verifier-port", "50051"])
    argv = dict(launcher._child_commands(args, "/resolved/snapshot"))["gateway"]
    assert argv[argv.index("--model-alias") + 1] == MODEL_PATH
