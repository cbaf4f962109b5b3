"""presence/frequency penalties, min_tokens, logit_bias and min_p (issue #30, item 3).

`process_logits` is checked against a reference written with plain torch, one position and
one token at a time, on the same logits; the engine's greedy output must not depend on
speculation when these are set.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from specdec.engine.logits_processor import process_logits
from specdec.engine.rejection_sampler import needs_only_argmax
from specdec.engine.sampling_params import SamplingParams
from specdec.errors import InvalidRequestError
from specdec.v1 import specdec_pb2
from tests.support.engine_harness import PROMPTS, generate, ngram_engine
from tests.support.tiny_models import make_tiny_llama
from verifier_svc.requests import check_request
from verifier_svc.servicer import sampling_params_from_proto

VOCAB_SIZE = 12
EOS_ID = 11
PROMPT_IDS = [1, 2, 3, 2]
OUTPUT_IDS = [4, 4, 5, 2]
DRAFT_IDS = [4, 6, 6]


def reference_logits(logits: Tensor, prompt_ids: list[int], output_ids: list[int], draft_ids: list[int],
                     params: SamplingParams, eos_ids: tuple[int, ...]) -> Tensor:
    """vLLM's order, token by token: bias, min_tokens, repetition, frequency/presence,
    then (sampled) temperature, min_p, top-k, top-p. Position i has draft_ids[:i] output."""
    rows = []
    for position in range(logits.shape[0]):
        row = logits[position].double().clone()
        outputs = output_ids + draft_ids[:position]
        for token_id, bias in params.logit_bias:
            row[token_id] += bias
        if len(outputs) < params.min_tokens:
            for token_id in list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids)):
                row[token_id] = -math.inf
        for token_id in set(prompt_ids + outputs):
            value = float(row[token_id])
            row[token_id] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        for token_id in set(outputs):
            row[token_id] -= params.frequency_penalty * outputs.count(token_id) + params.presence_penalty
        if not params.is_greedy:
            row = row / params.temperature
            probs = torch.softmax(row, dim=0)
            row[probs < params.min_p * probs.max()] = -math.inf
            if params.top_k != -1:
                row[row < row.sort(descending=True).values[params.top_k - 1]] = -math.inf
            probs = torch.softmax(row, dim=0)
            kept, total = set(), 0.0
            for token_id in probs.argsort(descending=True).tolist():
                kept.add(token_id)
                total += float(probs[token_id])
                if total >= params.top_p:
                    break
            for token_id in range(row.shape[0]):
                if token_id not in kept:
                    row[token_id] = -math.inf
        rows.append(row)
    return torch.stack(rows).float()


CASES = [
    ("presence", SamplingParams(temperature=0.0, presence_penalty=1.5)),
    ("frequency", SamplingParams(temperature=0.0, frequency_penalty=0.7)),
    ("negative-penalties", SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=-2.0)),
    ("logit-bias", SamplingParams(temperature=0.0, logit_bias={0: 100.0, 7: -100.0, 3: 2.5})),
    ("min-tokens", SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=(9,))),
    ("min-tokens-ignore-eos", SamplingParams(temperature=0.0, min_tokens=7, ignore_eos=True, stop_token_ids=(9,))),
    ("min-p", SamplingParams(temperature=0.7, min_p=0.2)),
    ("everything", SamplingParams(temperature=0.9, top_k=6, top_p=0.8, min_p=0.05, repetition_penalty=1.3,
                                  presence_penalty=0.4, frequency_penalty=0.3, min_tokens=6,
                                  logit_bias={4: 1.0, 8: -3.0}, stop_token_ids=(9,))),
    ("everything-greedy", SamplingParams(temperature=0.0, repetition_penalty=0.8, presence_penalty=-0.5,
                                         frequency_penalty=1.1, min_tokens=5, logit_bias={6: 0.5})),
]


@pytest.mark.parametrize("params", [case[1] for case in CASES], ids=[case[0] for case in CASES])
def test_process_logits_matches_plain_torch_reference(params: SamplingParams) -> None:
    logits = 2.0 * torch.randn(len(DRAFT_IDS) + 1, VOCAB_SIZE, generator=torch.Generator().manual_seed(7))
    got = process_logits(logits, PROMPT_IDS + OUTPUT_IDS, DRAFT_IDS, params, prompt_len=len(PROMPT_IDS),
                         eos_token_ids=(EOS_ID,))
    want = reference_logits(logits, PROMPT_IDS, OUTPUT_IDS, DRAFT_IDS, params, (EOS_ID,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, logits)  # every case changes something


def test_penalties_count_output_and_drafts_not_prompt() -> None:
    logits = torch.zeros(3, VOCAB_SIZE)
    params = SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5)
    got = process_logits(logits, [7, 7, 7, 4], [4, 8], params, prompt_len=3)
    # Prompt token 7 is never penalised; output 4 is (count 1, then 2 with draft 0); draft 8 from row 2.
    assert got[:, 7].tolist() == [0.0, 0.0, 0.0]
    assert got[:, 4].tolist() == [-1.5, -2.0, -2.0]
    assert got[:, 8].tolist() == [0.0, 0.0, -1.5]


def test_min_tokens_counts_drafts_and_stops_masking() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(5,))
    got = process_logits(torch.zeros(4, VOCAB_SIZE), [1, 2, 9], [3, 3, 3], params, prompt_len=2,
                         eos_token_ids=(EOS_ID,))
    # One output token before row 0, so rows 0 and 1 (1 and 2 outputs) are masked, row 2 is not.
    assert got[:, 5].tolist() == [-math.inf, -math.inf, 0.0, 0.0]
    assert got[:, EOS_ID].tolist() == [-math.inf, -math.inf, 0.0, 0.0]


def test_new_processing_disables_the_argmax_shortcut() -> None:
    assert needs_only_argmax(SamplingParams(temperature=0.0))
    assert needs_only_argmax(SamplingParams(temperature=0.0, min_p=0.5))  # argmax-invariant
    for overrides in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"min_tokens": 1},
                      {"logit_bias": {3: 1.0}}):
        assert not needs_only_argmax(SamplingParams(temperature=0.0, **overrides))


@pytest.mark.parametrize("overrides,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"min_tokens": 17}, "min_tokens"),  # above max_tokens=16
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias"),
    ({"logit_bias": 5}, "logit_bias"),
])
def test_sampling_params_bounds(overrides: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**overrides)  # type: ignore[arg-type]
    assert excinfo.value.param == param


def test_proto_carries_every_field_to_sampling_params() -> None:
    message = specdec_pb2.SamplingParams(temperature=0.5, max_tokens=9, presence_penalty=-1.5,
                                         frequency_penalty=0.25, min_tokens=4, logit_bias={3: 2.5, 1: -100.0},
                                         min_p=0.125)
    params = sampling_params_from_proto(message, max_model_len=64, prompt_len=3)
    assert (params.presence_penalty, params.frequency_penalty, params.min_tokens, params.min_p) == (
        -1.5, 0.25, 4, 0.125)
    assert params.logit_bias == ((1, -100.0), (3, 2.5))
    defaults = sampling_params_from_proto(specdec_pb2.SamplingParams(), max_model_len=64, prompt_len=3)
    assert not defaults.moves_argmax and defaults.min_p == 0.0


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    check_request([1, 2], SamplingParams(logit_bias={VOCAB_SIZE - 1: 1.0}), VOCAB_SIZE, 64)
    with pytest.raises(InvalidRequestError) as excinfo:
        check_request([1, 2], SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), VOCAB_SIZE, 64)
    assert excinfo.value.param == "logit_bias"


# ----------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-penalties"))


MAX_TOKENS = 20


async def _outputs(model_dir: Path, device: str, k: int | None, params: SamplingParams) -> tuple[list[list[int]], int]:
    async with ngram_engine(model_dir, device, k=k) as engine:
        outputs = [await generate(engine, prompt, params) for prompt in PROMPTS]
        return outputs, engine.spec.num_accepted_tokens


def test_greedy_penalties_are_the_same_with_and_without_speculation(tiny_model: Path, device) -> None:
    plain_params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain, _ = asyncio.run(_outputs(tiny_model, str(device), None, plain_params))
    # Stop on the plain output's 3rd token, but not before the 8th: min_tokens must hold it back.
    stop_id = plain[0][2]
    # Negative penalties encourage repeats, so the ngram drafter's drafts get accepted.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, presence_penalty=-0.4, frequency_penalty=-0.3,
                            logit_bias={plain[1][0]: -1.0, 7: 0.5}, min_tokens=8, stop_token_ids=(stop_id,),
                            ignore_eos=True)
    without_spec, _ = asyncio.run(_outputs(tiny_model, str(device), None, params))
    with_spec, num_accepted = asyncio.run(_outputs(tiny_model, str(device), 3, params))
    assert with_spec == without_spec
    assert num_accepted > 0, "no draft was ever accepted: speculation was not exercised"
    assert without_spec != plain  # the penalties and the bias change the output
    assert stop_id not in without_spec[0][:8] and len(without_spec[0]) >= 8
