"""Speculation switched off by the adaptive policy says so (issue 43, item 4).

An engine whose policy has measured that drafting does not pay (drafting steps that
yielded less than plain ones, drafts never accepted) drafts nothing; each request's
counters carry the policy's reason with its figures, the gateway passes it on as
`usage.speculation.policy`, and the log says why once, at info level.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.generation import speculation_usage
from specdec.engine.sampling_params import SamplingParams
from tests.support.engine_harness import served_engine
from tests.support.policy_training import NGRAM, measured_that_drafting_does_not_pay
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.servicer import speculation_to_proto


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-policy-reason"))


async def test_a_request_the_policy_does_not_draft_for_is_told_why(
        tiny_model: Path, device, caplog: pytest.LogCaptureFixture) -> None:
    async with served_engine(tiny_model, NGRAM, str(device), adaptive_speculation=True) as engine:
        assert engine.speculation.policy is not None
        measured_that_drafting_does_not_pay(engine.speculation.policy)
        with caplog.at_level(logging.INFO, logger="specdec.engine.adaptive_speculation"):
            specs = []
            for _ in range(2):
                _, queue = engine.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(
                    temperature=0.0, max_tokens=12, ignore_eos=True))
                outputs = []
                while not outputs or outputs[-1].finish_reason is None:
                    outputs.append(await queue.get())
                specs.append(outputs[-1].spec)
    for spec in specs:
        assert spec.num_drafts == 0
        assert spec.policy == "off: drafting yields 0.50x plain decoding at batch size 1"
    usage = speculation_usage(speculation_to_proto(specs[0]))
    assert usage["policy"] == specs[0].policy and usage["num_drafts"] == 0
    told = [r.getMessage() for r in caplog.records if "policy is not drafting" in r.getMessage()]
    assert len(told) == 1 and specs[0].policy in told[0]
    assert all(r.levelno == logging.INFO for r in caplog.records if "policy is not drafting" in r.getMessage())
