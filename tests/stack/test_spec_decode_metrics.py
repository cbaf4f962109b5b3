"""vLLM's per-request speculative metrics (`--per-request-spec-decode-metrics summary` and
`detailed`), in vLLM's field names and place, beside specdec's own usage.speculation
(issue 43, item 4).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import pytest
from openai import OpenAI

from gateway.config import GatewayConfig
from specdec.errors import ConfigError
from tests.support.served_stack import served_stack
from tests.support.tiny_models import make_tiny_llama

PROMPT = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"


class Served(NamedTuple):
    base_url: str
    metrics_mode: str  # --per-request-spec-decode-metrics


@pytest.fixture(scope="module", params=["summary", "detailed"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec-metrics"))
    with served_stack(model, "--served-model-name", "tiny",
                      "--per-request-spec-decode-metrics", request.param) as running:
        yield Served(running.base_url, request.param)


SUMMARY_FIELDS = {"num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens",
                  "mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram",
                  "num_spec_tokens"}


def check_summary(metrics: dict, speculation: dict, mode: str) -> None:
    """vLLM's figures, consistent with each other and with specdec's own counters; with
    `detailed`, the per-step lists consistent with them."""
    summary = metrics["speculative_decoding"]
    if mode == "summary":
        assert set(summary) == SUMMARY_FIELDS
    else:
        assert set(summary) == SUMMARY_FIELDS | {"per_step_drafted", "per_step_accepted"}
        drafted, accepted = summary["per_step_drafted"], summary["per_step_accepted"]
        assert len(drafted) == len(accepted) == summary["num_spec_steps"]
        assert all(0 <= a <= d <= 3 for a, d in zip(accepted, drafted))
        assert sum(drafted) == summary["num_draft_tokens"]
        assert sum(accepted) == summary["num_accepted_draft_tokens"]
        assert summary["acceptance_histogram"] == [accepted.count(j) for j in range(3 + 1)]
    assert summary["num_spec_tokens"] == 3
    histogram = summary["acceptance_histogram"]
    assert len(histogram) == 3 + 1  # k + 1
    assert summary["num_spec_steps"] == sum(histogram) == speculation["num_drafts"] > 0
    assert summary["num_accepted_draft_tokens"] == sum(j * n for j, n in enumerate(histogram)) \
        == speculation["num_accepted_tokens"]
    assert summary["num_draft_tokens"] == speculation["num_draft_tokens"]
    assert summary["mean_acceptance_length"] == pytest.approx(speculation["mean_acceptance_length"])
    assert summary["draft_acceptance_rate"] == pytest.approx(speculation["acceptance_rate"])


def test_a_response_carries_vllms_summary_beside_specdecs_usage(stack: Served) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                           temperature=0, extra_body={"ignore_eos": True})
    check_summary(completion.model_extra["metrics"], completion.usage.model_extra["speculation"],
                  stack.metrics_mode)


def test_a_stream_carries_it_in_its_last_chunk_with_the_usage(stack: Served) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    with_metrics = [chunk for chunk in chunks if (chunk.model_extra or {}).get("metrics")]
    assert len(with_metrics) == 1 and with_metrics[0] is chunks[-1]
    last = chunks[-1]
    check_summary(last.model_extra["metrics"], last.usage.model_extra["speculation"],
                  stack.metrics_mode)


def test_a_request_with_several_choices_gets_null_as_in_vllm(stack: Served) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.model_extra["metrics"] == {"speculative_decoding": None}
    assert completion.usage.model_extra["speculation"]["num_drafts"] > 0


def test_an_unknown_mode_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        GatewayConfig(model="m", verifier_addresses=("127.0.0.1:1",),
                      per_request_spec_decode_metrics="verbose")
    assert info.value.param == "per_request_spec_decode_metrics"
    assert "--per-request-spec-decode-metrics" in info.value.message
