"""The adaptive policy's state per sequence (drafting, probing, off) reaches each response's
`usage.speculation.policy_state` and the `specdec:speculation_policy_sequences` gauge
(issue 48, item 4); `usage.speculation.policy` keeps saying why when it is not drafting."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from gateway.generation import speculation_usage, sum_speculation
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.sequence import SpeculationCounters
from tests.support.engine_harness import served_engine
from tests.support.policy_training import MS, NGRAM, measured_that_drafting_does_not_pay, policy_with_cost, teach
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.metrics import VerifierMetrics
from verifier_svc.requests import collect_outputs
from verifier_svc.servicer import speculation_to_proto
from verifier_svc.speculation.candidate import Candidate
from verifier_svc.speculation.policy import DRAFTING, OFF, PROBING, SpeculationPolicy
from verifier_svc.speculation.probe_schedule import PROBE_INTERVAL


def test_each_plan_names_every_drafting_sequences_state() -> None:
    policy = policy_with_cost(5 * MS, 1 * MS)
    teach(policy, 0, num_drafts=30, k=4, num_accepted=4)   # always accepted: drafts
    teach(policy, 1, num_drafts=30, k=4, num_accepted=0)   # never: off, probed now and then
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    for _ in range(6 * PROBE_INTERVAL):
        plan = policy.plan([Candidate(0, 4), Candidate(1, 4), Candidate(2, 0)])
        assert set(policy.states) == {0, 1}  # 2 may not draft: it has no state
        for seq_id in (0, 1):
            seen[seq_id].add(policy.states[seq_id])
        assert policy.states[0] == DRAFTING and plan[0] > 0
        expected = PROBING if 1 in policy.last_probes else OFF
        assert policy.states[1] == expected and (plan[1] > 0) == (expected == PROBING)
    assert seen == {0: {DRAFTING}, 1: {OFF, PROBING}}


def test_before_anything_is_measured_every_sequence_drafts() -> None:
    policy = SpeculationPolicy(4)
    policy.plan([Candidate(7, 4)])
    assert policy.states == {7: DRAFTING}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-policy-state"))


async def test_a_requests_usage_carries_the_policys_state(tiny_model: Path, device) -> None:
    async with served_engine(tiny_model, NGRAM, str(device), adaptive_speculation=True) as engine:
        assert engine.speculation.policy is not None
        measured_that_drafting_does_not_pay(engine.speculation.policy)
        _, queue = engine.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True))
        _, spec = await collect_outputs(queue)
    assert spec is not None and spec.num_drafts == 0
    assert spec.policy_state == OFF and spec.policy.startswith("off: drafting yields")
    usage = speculation_usage(speculation_to_proto(spec))
    assert usage["policy_state"] == OFF and usage["policy"] == spec.policy
    # n choices: one state, as one reason.
    two = [SimpleNamespace(speculation=speculation_to_proto(spec)) for _ in range(2)]
    assert speculation_usage(sum_speculation(two))["policy_state"] == OFF  # type: ignore[arg-type]


async def test_a_fixed_policy_has_no_state(tiny_model: Path, device) -> None:
    async with served_engine(tiny_model, NGRAM, str(device), adaptive_speculation=False) as engine:
        _, queue = engine.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True))
        _, spec = await collect_outputs(queue)
    assert spec is not None and spec.policy_state == "" and spec.policy == ""


def engine_with_running(states: list[str]) -> SimpleNamespace:
    """What the metrics collector reads of an engine, with running sequences in `states`."""
    block_manager = SimpleNamespace(num_queried_tokens=0, num_hit_tokens=0,
                                    num_evicted_blocks=0, usage=0.0, num_free_blocks=1,
                                    num_blocks=1, num_cached_blocks=0)
    running = [SimpleNamespace(spec=SpeculationCounters(policy_state=state)) for state in states]
    return SimpleNamespace(spec=SpeculationCounters(), drafter_pool=None, num_running=len(states),
                           num_waiting=0, scheduler=SimpleNamespace(
                               running=running, num_preemptions=0, block_manager=block_manager))


def test_the_gauge_counts_running_sequences_by_state() -> None:
    metrics = VerifierMetrics(engine_with_running([DRAFTING, OFF, OFF, PROBING, ""]), "m")
    text = generate_latest(metrics.registry).decode()
    for state, count in ((DRAFTING, 1), (PROBING, 1), (OFF, 2)):
        assert (f'specdec:speculation_policy_sequences{{model_name="m",state="{state}"}} '
                f'{count}.0') in text
    idle = generate_latest(VerifierMetrics(engine_with_running([]), "m").registry).decode()
    assert 'specdec:speculation_policy_sequences{model_name="m",state="off"} 0.0' in idle
