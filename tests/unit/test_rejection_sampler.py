"""Rejection sampler: greedy tables, seeded determinism, and statistical losslessness.

The statistical tests sample the real `verify` many times with fixed seeds (so they are
deterministic) and compare the emitted tokens with a target distribution computed here
independently of `specdec.engine.logits_processor`, by Pearson's chi-square test. Negative controls
run deliberately wrong samplers through the same check and require it to fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

from specdec.engine.rejection_sampler import (
    accept_greedy,
    argmax_ids,
    needs_only_argmax,
    verify,
)
from specdec.engine.position_random import PositionRandom
from specdec.engine.sampling_params import SamplingParams
from tests.support.target_distribution import target_probs_from_logits

GREEDY = SamplingParams(temperature=0.0)
VOCAB_SIZE = 8
MIN_P_VALUE = 1e-3
NUM_SAMPLES = 16_000  # per statistical test; the negative controls need far fewer

Sampler = Callable[[Tensor, list[int], list[int], SamplingParams, torch.Generator | None, Tensor | None], list[int]]
DraftSource = Callable[[], tuple[list[int], Tensor | None]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # These tensors are tiny: waking an OpenMP pool per op costs more than the op itself.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def _logits_with_argmax(argmax_ids: list[int], vocab_size: int = 16) -> Tensor:
    logits = torch.linspace(-1.0, 1.0, vocab_size).repeat(len(argmax_ids), 1)  # [n, vocab]
    for row, token_id in enumerate(argmax_ids):
        logits[row, token_id] = 5.0
    return logits


# ---------------------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    ("argmax_ids", "draft_token_ids", "expected"),
    [
        ([4], [], [4]),  # k = 0: plain decoding
        ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3, 4], [0, 2, 3], [1]),  # first rejected: recovered only
        ([1, 2, 3, 4], [1, 0, 3], [1, 2]),  # middle rejected
        ([1, 2, 3, 4], [1, 2, 0], [1, 2, 3]),  # last rejected
        ([7, 7], [7], [7, 7]),  # repeats are fine without a penalty
    ],
)
def test_greedy_verify(argmax_ids: list[int], draft_token_ids: list[int], expected: list[int]) -> None:
    logits = _logits_with_argmax(argmax_ids)
    assert verify(logits, draft_token_ids, [9, 10], GREEDY, None) == expected
    # Draft probabilities and the generator play no part in a greedy request.
    draft_probs = torch.full((len(draft_token_ids), 16), 1 / 16)
    generator = torch.Generator().manual_seed(0)
    assert verify(logits, draft_token_ids, [9, 10], GREEDY, generator, draft_probs) == expected


@pytest.mark.parametrize(
    ("history_ids", "draft_token_ids", "penalty", "expected"),
    [
        ([], [0, 1], 1.0, [0, 0]),  # no penalty: argmax 0 everywhere, draft 1 rejected
        ([], [0, 1], 2.0, [0, 1, 2]),  # row 1 sees draft 0, row 2 sees drafts 0 and 1
        ([0], [1, 2], 2.0, [1, 2, 0]),  # the history is penalised from row 0 on
        ([0], [2, 1], 2.0, [1]),  # row 0's argmax is 1 once 0 is penalised
    ],
)
def test_greedy_verify_repetition_penalty(
    history_ids: list[int], draft_token_ids: list[int], penalty: float, expected: list[int]
) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.2, -3.0]]).repeat(len(draft_token_ids) + 1, 1)  # [k + 1, 4]
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    assert verify(logits, draft_token_ids, history_ids, params, None) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_steps_argmax_gives_verifys_greedy_answer(dtype: torch.dtype) -> None:
    """The engine's shortcut for greedy requests without a penalty: one argmax over the step's
    rows, then `accept_greedy` on each sequence's slice, is `verify` for each sequence,
    including rows whose top logits tie after bf16 rounding (the first index wins both ways)."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 300, generator=generator).to(dtype)
    logits[4, 10] = logits[4, 20] = logits[4].max() + 1  # a tie
    ids = argmax_ids(logits)
    assert ids[4] == 10
    offsets, drafts = [0, 1, 5, 9], [[], [ids[1], ids[2], 0], [ids[5], ids[6], ids[7]]]
    for first, end, draft in zip(offsets, offsets[1:], drafts):
        expected = verify(logits[first:end], draft, [1, 2], GREEDY, None)
        assert accept_greedy(ids[first:end], draft) == expected
    assert needs_only_argmax(GREEDY)
    assert not needs_only_argmax(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert not needs_only_argmax(SamplingParams(temperature=0.7))


# --------------------------------------------------------------- sampled, exact cases


def _emit_in_steps(logits: Tensor, random: PositionRandom, steps: list[int], drafts: Callable[[int, int], list[int]],
                   params: SamplingParams, first_position: int = 0) -> list[int]:
    """A seeded request's tokens over `logits` (row p: output position p's target row) from
    output position `first_position` on, verified in steps of steps[i] + 1 rows with the
    drafts `drafts(position, k)` proposes."""
    emitted: list[int] = []
    for num_drafts in steps:
        position = first_position + len(emitted)
        if position >= logits.shape[0] - num_drafts:
            break
        draft = drafts(position, num_drafts)
        emitted += verify(logits[position:position + num_drafts + 1], draft, [], params,
                          random.starting_at(position))
    return emitted


def test_a_seeded_request_draws_per_position_whatever_the_steps() -> None:
    """The random stream is per request and per output position: the same seed gives the same
    tokens decoded one at a time and verified in windows of any size with any drafts (right,
    wrong or none), so load, batching and speculation cannot change a seeded answer."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 50, generator=generator) * 2  # [positions, vocab]
    params = SamplingParams(temperature=1.0, seed=7)
    random = PositionRandom(7)
    plain = _emit_in_steps(logits, random, [0] * 64, lambda p, k: [], params)
    assert len(set(plain)) > 5
    # Drafts that are the plain tokens (accepted), others (rejected), and a mix.
    right = lambda p, k: plain[p:p + k]  # noqa: E731
    wrong = lambda p, k: [(t + 1) % 50 for t in plain[p:p + k]]  # noqa: E731
    mixed = lambda p, k: plain[p:p + k // 2] + [(t + 1) % 50 for t in plain[p + k // 2:p + k]]  # noqa: E731
    for steps in ([3] * 64, [1, 4, 0, 2] * 16, [7] * 64):
        for drafts in (right, wrong, mixed):
            emitted = _emit_in_steps(logits, random, steps, drafts, params)
            assert emitted == plain[:len(emitted)] and len(emitted) >= 56
    # Resumed at position 30 (a request retried with the tokens it already has): the same
    # draws from there on, where one generator drawn in turn would start over.
    resumed = _emit_in_steps(logits, PositionRandom(7), [2] * 34, right, params, first_position=30)
    assert resumed == plain[30:30 + len(resumed)] and len(resumed) >= 30
    assert _emit_in_steps(logits, PositionRandom(8), [0] * 64, lambda p, k: [], params) != plain



def test_sampled_certain_accept_and_certain_reject() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[5.0, 1.0, 0.0, -9.0]]).repeat(3, 1)  # [3, 4]
    top_one = SamplingParams(top_k=1)  # one-hot target: accept iff the draft is its argmax
    for _ in range(50):
        assert verify(logits, [0, 0], [], top_one, generator) == [0, 0, 0]
        assert verify(logits, [0, 3], [], top_one, generator) == [0, 0]
    masked = SamplingParams(top_k=3)  # token 3 has probability 0: always rejected, never emitted
    for _ in range(200):
        output_ids = verify(logits, [3, 3], [], masked, generator)
        assert len(output_ids) == 1 and output_ids[0] != 3


def test_draft_probs_equal_to_target_are_always_accepted() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB_SIZE, generator=generator)  # [4, 8]
    params = SamplingParams(temperature=0.9)
    for _ in range(100):
        draft_token_ids = torch.randint(VOCAB_SIZE, (3,), generator=generator).tolist()
        target_probs = target_probs_from_logits(logits, [], draft_token_ids, params)  # [4, 8]
        output_ids = verify(logits, draft_token_ids, [], params, generator, target_probs[:3])
        assert output_ids[:3] == draft_token_ids and len(output_ids) == 4


# ------------------------------------------------------------------ determinism


def _sample_run(seed: int, with_draft_probs: bool) -> list[list[int]]:
    data_generator = torch.Generator().manual_seed(42)  # same inputs every run
    logits = torch.randn(4, 32, generator=data_generator)  # [4, 32]
    draft_probs = torch.softmax(torch.randn(3, 32, generator=data_generator), dim=-1) if with_draft_probs else None
    params = SamplingParams(temperature=1.3, top_p=0.95, repetition_penalty=1.1, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    outputs = []
    for step in range(100):
        draft_token_ids = [step % 32, (3 * step) % 32, (7 * step) % 32]
        outputs.append(verify(logits, draft_token_ids, [1, 2, 3], params, generator, draft_probs))
    return outputs


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_seeded_determinism(with_draft_probs: bool) -> None:
    assert _sample_run(7, with_draft_probs) == _sample_run(7, with_draft_probs)
    assert _sample_run(7, with_draft_probs) != _sample_run(8, with_draft_probs)


def test_cpu_generator_drives_logits_on_any_device(device: torch.device) -> None:
    # The engine seeds a CPU generator; logits may live on an accelerator (`pytest --device`).
    data_generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 64, generator=data_generator)  # [3, 64]
    draft_probs = torch.softmax(torch.randn(2, 64, generator=data_generator), dim=-1)  # [2, 64]
    params = SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.2, seed=3)
    outputs = {}
    for run_device in (torch.device("cpu"), device):
        generator = torch.Generator().manual_seed(3)
        outputs[run_device.type] = [
            verify(logits.to(run_device), [step % 64, 7], [1, 2], params, generator, draft_probs.to(run_device))
            for step in range(30)
        ]
    assert outputs["cpu"] == outputs[device.type]


def test_default_generator_when_none() -> None:
    logits = torch.zeros(2, VOCAB_SIZE)
    output_ids = verify(logits, [3], [], SamplingParams(), None)
    assert 1 <= len(output_ids) <= 2 and all(0 <= t < VOCAB_SIZE for t in output_ids)


# ------------------------------------------------------------ statistical tests


def chi_square_p_value(counts: Tensor, expected_probs: Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value of `counts` [vocab] against `expected_probs`.

    Any count on a token of expected probability 0 is an outright failure (p-value 0).
    """
    counts = counts.double()
    expected_probs = expected_probs.double()
    support = expected_probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected_counts = expected_probs[support] / expected_probs[support].sum() * counts.sum()
    assert expected_counts.min() >= 5, "too few samples for a chi-square test"
    statistic = ((counts[support] - expected_counts) ** 2 / expected_counts).sum()
    degrees_of_freedom = int(support.sum()) - 1
    if degrees_of_freedom == 0:
        return 1.0
    # The chi-square survival function is the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2, dtype=torch.float64), statistic / 2))


def test_chi_square_p_value_helper() -> None:
    # With 2 degrees of freedom the survival function is exp(-x / 2).
    counts = torch.tensor([60.0, 40.0, 100.0])
    expected = torch.tensor([0.25, 0.25, 0.5])
    statistic = (10.0**2 / 50 + 10.0**2 / 50 + 0.0)
    assert chi_square_p_value(counts, expected) == pytest.approx(math.exp(-statistic / 2))
    assert chi_square_p_value(torch.tensor([50.0, 50.0, 100.0]), expected) == pytest.approx(1.0)
    assert chi_square_p_value(torch.tensor([50.0, 50.0, 1.0]), torch.tensor([0.5, 0.5, 0.0])) == 0.0


def reference_target_probs(logits_row: Tensor, context_ids: list[int], params: SamplingParams) -> Tensor:
    """The target distribution, written plainly and independently of specdec.engine.logits_processor."""
    values = []
    for token_id, logit in enumerate(logits_row.tolist()):
        if token_id in context_ids:
            logit = logit / params.repetition_penalty if logit > 0 else logit * params.repetition_penalty
        values.append(logit / params.temperature)
    ranked_ids = sorted(range(len(values)), key=lambda token_id: -values[token_id])
    if params.top_k != -1:
        ranked_ids = ranked_ids[: params.top_k]
    weights = {token_id: math.exp(values[token_id]) for token_id in ranked_ids}
    total_weight = sum(weights.values())
    probs = torch.zeros(len(values), dtype=torch.float64)
    cumulative = 0.0
    for token_id in ranked_ids:
        probs[token_id] = weights[token_id]
        cumulative += weights[token_id] / total_weight
        if cumulative >= params.top_p:
            break
    return probs / probs.sum()


def sample_emitted_tokens(
    sampler: Sampler,
    target_logits: Tensor,
    history_ids: list[int],
    params: SamplingParams,
    draft_source: DraftSource,
    num_samples: int,
    seed: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Counts [vocab] of the 1st emitted token, the 2nd given the 1st draft accepted, and the 3rd
    given the 1st and 2nd accepted, over `num_samples` verify steps of a k = 2 draft."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(3, VOCAB_SIZE, dtype=torch.long)  # [emitted position, vocab]
    for _ in range(num_samples):
        draft_token_ids, draft_probs = draft_source()
        output_ids = sampler(target_logits, draft_token_ids, history_ids, params, generator, draft_probs)
        for position, token_id in enumerate(output_ids[:3]):
            counts[position, token_id] += 1
    return counts[0], counts[1], counts[2]


# A fixed random target over 8 tokens; row i is the target's position i.
_TARGET_LOGITS = 1.5 * torch.randn(3, VOCAB_SIZE, generator=torch.Generator().manual_seed(2023))  # [3, 8]
_HISTORY_IDS = [5, 1]
_PENALISED = SamplingParams(temperature=0.8, top_p=0.9, top_k=7, repetition_penalty=1.3)
_UNPENALISED = SamplingParams(temperature=1.2, top_k=6)


def _greedy_drafts() -> tuple[list[int], DraftSource]:
    """Fixed one-hot drafts: at each position the target's second most likely token."""
    first_id = int(reference_target_probs(_TARGET_LOGITS[0], _HISTORY_IDS, _PENALISED).argsort()[-2])
    second_id = int(reference_target_probs(_TARGET_LOGITS[1], _HISTORY_IDS + [first_id], _PENALISED).argsort()[-2])
    return [first_id, second_id], lambda: ([first_id, second_id], None)


def _probabilistic_drafts() -> tuple[Tensor, DraftSource]:
    """Drafts sampled from a fixed distribution unlike the target's, passed as draft_probs."""
    draft_generator = torch.Generator().manual_seed(99)
    draft_probs = torch.softmax(2.0 * torch.randn(2, VOCAB_SIZE, generator=draft_generator), dim=-1)  # [2, 8]

    def draw() -> tuple[list[int], Tensor | None]:
        draft_ids = torch.multinomial(draft_probs, 1, generator=draft_generator).squeeze(1).tolist()
        return draft_ids, draft_probs

    return draft_probs, draw


def test_plain_decoding_matches_target() -> None:
    first, _, _ = sample_emitted_tokens(
        verify, _TARGET_LOGITS[:1], _HISTORY_IDS, _PENALISED, lambda: ([], None), NUM_SAMPLES, seed=1
    )
    expected = reference_target_probs(_TARGET_LOGITS[0], _HISTORY_IDS, _PENALISED)
    assert (expected == 0).sum() >= 1  # the masks matter here
    assert chi_square_p_value(first, expected) > MIN_P_VALUE


def test_greedy_drafts_sampled_request_matches_target() -> None:
    (first_id, second_id), draft_source = _greedy_drafts()
    first, second, third = sample_emitted_tokens(
        verify, _TARGET_LOGITS, _HISTORY_IDS, _PENALISED, draft_source, NUM_SAMPLES, seed=2
    )
    expected_first = reference_target_probs(_TARGET_LOGITS[0], _HISTORY_IDS, _PENALISED)
    assert 0.1 < expected_first[first_id] < 0.9  # the draft is sometimes wrong
    assert chi_square_p_value(first, expected_first) > MIN_P_VALUE
    # The 2nd token exists only when the 1st draft was accepted; its context then holds it.
    assert second.sum() == first[first_id]
    expected_second = reference_target_probs(_TARGET_LOGITS[1], _HISTORY_IDS + [first_id], _PENALISED)
    assert chi_square_p_value(second, expected_second) > MIN_P_VALUE
    expected_third = reference_target_probs(_TARGET_LOGITS[2], _HISTORY_IDS + [first_id, second_id], _PENALISED)
    assert chi_square_p_value(third, expected_third) > MIN_P_VALUE


def test_probabilistic_drafts_match_target() -> None:
    draft_probs, draft_source = _probabilistic_drafts()
    first, second, third = sample_emitted_tokens(
        verify, _TARGET_LOGITS, [], _UNPENALISED, draft_source, NUM_SAMPLES, seed=3
    )
    expected = [reference_target_probs(_TARGET_LOGITS[row], [], _UNPENALISED) for row in range(3)]
    # The drafter proposes tokens the target masks out, and its distribution is far off.
    assert bool(((expected[0] == 0) & (draft_probs[0] > 0.01)).any())
    assert (expected[0] - draft_probs[0].double()).abs().sum() > 0.5
    assert chi_square_p_value(first, expected[0]) > MIN_P_VALUE
    assert chi_square_p_value(second, expected[1]) > MIN_P_VALUE
    assert chi_square_p_value(third, expected[2]) > MIN_P_VALUE


# ----------------------------------------------------------- negative controls


def accept_always(
    target_logits: Tensor,
    draft_token_ids: list[int],
    history_ids: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: Tensor | None = None,
) -> list[int]:
    """Wrong: keeps every draft token."""
    target_probs = target_probs_from_logits(target_logits, history_ids, draft_token_ids, params)
    return list(draft_token_ids) + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


def recover_from_target(
    target_logits: Tensor,
    draft_token_ids: list[int],
    history_ids: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: Tensor | None = None,
) -> list[int]:
    """Wrong, subtly: the right acceptance test, but recovers from target_probs, not the residual."""
    target_probs = target_probs_from_logits(target_logits, history_ids, draft_token_ids, params)
    for position, draft_id in enumerate(draft_token_ids):
        draft_prob = 1.0 if draft_probs is None else float(draft_probs[position, draft_id])
        if float(torch.rand((), generator=generator)) * draft_prob >= float(target_probs[position, draft_id]):
            recovered_id = int(torch.multinomial(target_probs[position], 1, generator=generator))
            return list(draft_token_ids[:position]) + [recovered_id]
    return list(draft_token_ids) + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


@pytest.mark.parametrize("wrong_sampler", [accept_always, recover_from_target])
@pytest.mark.parametrize("drafts", ["greedy", "probabilistic"])
def test_wrong_samplers_fail_the_check(wrong_sampler: Sampler, drafts: str) -> None:
    if drafts == "greedy":
        _, draft_source = _greedy_drafts()
        history_ids, params = _HISTORY_IDS, _PENALISED
    else:
        _, draft_source = _probabilistic_drafts()
        history_ids, params = [], _UNPENALISED
    first, _, _ = sample_emitted_tokens(wrong_sampler, _TARGET_LOGITS, history_ids, params, draft_source, 2_000, seed=4)
    expected = reference_target_probs(_TARGET_LOGITS[0], history_ids, params)
    assert chi_square_p_value(first, expected) < 1e-9


# ----------------------------------------------------------- a penalised target

_PROMPT_IDS = [5, 1]
_OUTPUT_IDS = [3, 3, 2]
_PRESENCE_MIN_P = SamplingParams(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.6, min_p=0.08,
                                 logit_bias={6: 1.5})


def reference_penalised_probs(logits_row: Tensor, output_ids: list[int], params: SamplingParams) -> Tensor:
    """bias, presence/frequency over the output, temperature, then min_p: written plainly."""
    values = []
    for token_id, logit in enumerate(logits_row.tolist()):
        logit += dict(params.logit_bias).get(token_id, 0.0)
        count = output_ids.count(token_id)
        logit -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        values.append(logit / params.temperature)
    weights = [math.exp(value) for value in values]
    floor = params.min_p * max(weights)
    probs = torch.tensor([weight if weight >= floor else 0.0 for weight in weights], dtype=torch.float64)
    return probs / probs.sum()


def test_penalised_target_with_drafts_matches() -> None:
    """presence/frequency penalties, logit_bias and min_p: the first emitted token follows the
    penalised target, and the second (after an accepted draft) counts that draft as output."""
    expected_first = reference_penalised_probs(_TARGET_LOGITS[0], _OUTPUT_IDS, _PRESENCE_MIN_P)
    unpenalised = reference_target_probs(_TARGET_LOGITS[0], [], SamplingParams(temperature=0.9))
    assert (expected_first == 0).sum() >= 1  # min_p masks something
    assert (expected_first - unpenalised).abs().sum() > 0.2  # the penalties matter
    first_id = int(expected_first.argsort()[-2])
    assert 0.1 < expected_first[first_id] < 0.9  # the draft is sometimes wrong

    def sampler(target_logits: Tensor, draft_token_ids: list[int], history_ids: list[int],
                params: SamplingParams, generator: torch.Generator, draft_probs: Tensor | None) -> list[int]:
        return verify(target_logits, draft_token_ids, history_ids, params, generator, draft_probs,
                      prompt_len=len(_PROMPT_IDS))

    first, second, _ = sample_emitted_tokens(
        sampler, _TARGET_LOGITS[:2], _PROMPT_IDS + _OUTPUT_IDS, _PRESENCE_MIN_P, lambda: ([first_id], None),
        NUM_SAMPLES, seed=5)
    assert chi_square_p_value(first, expected_first) > MIN_P_VALUE
    assert 0.5 * float((first / first.sum() - expected_first).abs().sum()) < 0.02  # total variation
    expected_second = reference_penalised_probs(_TARGET_LOGITS[1], _OUTPUT_IDS + [first_id], _PRESENCE_MIN_P)
    assert chi_square_p_value(second, expected_second) > MIN_P_VALUE
