"""vLLM's per-request speculative metrics (`--per-request-spec-decode-metrics summary`),
in vLLM's field names and place, beside specdec's own usage.speculation (issue 43, item 4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from gateway.app import GatewayConfig
from specdec.errors import ConfigError
from tests.support.served_stack import Stack, served_stack
from tests.support.tiny_models import make_tiny_llama

PROMPT = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec-metrics"))
    with served_stack(model, "--served-model-name", "tiny",
                      "--per-request-spec-decode-metrics", "summary") as running:
        yield running


def check_summary(metrics: dict, speculation: dict) -> None:
    """vLLM's figures, consistent with each other and with specdec's own counters."""
    summary = metrics["speculative_decoding"]
    assert set(summary) == {"num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens",
                            "mean_acceptance_length", "draft_acceptance_rate",
                            "acceptance_histogram"}
    histogram = summary["acceptance_histogram"]
    assert len(histogram) == 3 + 1  # k + 1
    assert summary["num_spec_steps"] == sum(histogram) == speculation["num_drafts"] > 0
    assert summary["num_accepted_draft_tokens"] == sum(j * n for j, n in enumerate(histogram)) \
        == speculation["num_accepted_tokens"]
    assert summary["num_draft_tokens"] == speculation["num_draft_tokens"]
    assert summary["mean_acceptance_length"] == pytest.approx(speculation["mean_acceptance_length"])
    assert summary["draft_acceptance_rate"] == pytest.approx(speculation["acceptance_rate"])


def test_a_response_carries_vllms_summary_beside_specdecs_usage(stack: Stack) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                           temperature=0, extra_body={"ignore_eos": True})
    check_summary(completion.model_extra["metrics"], completion.usage.model_extra["speculation"])


def test_a_stream_carries_it_in_its_last_chunk_with_the_usage(stack: Stack) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    with_metrics = [chunk for chunk in chunks if (chunk.model_extra or {}).get("metrics")]
    assert len(with_metrics) == 1 and with_metrics[0] is chunks[-1]
    last = chunks[-1]
    check_summary(last.model_extra["metrics"], last.usage.model_extra["speculation"])


def test_detailed_metrics_are_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        GatewayConfig(model="m", verifier_addresses=("127.0.0.1:1",),
                      per_request_spec_decode_metrics="detailed")
    assert info.value.param == "per_request_spec_decode_metrics"
    assert "--per-request-spec-decode-metrics" in info.value.message
