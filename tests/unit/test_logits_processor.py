"""Logits processing: repetition penalty per position, logit_bias and its order, temperature,
min_p, top-k and top-p masks (presence/frequency penalties and min_tokens: tests/service/test_penalties.py)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.engine.logits_processor import (
    apply_repetition_penalty,
    argmax_rows,
    process_logits,
)
from specdec.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


@pytest.mark.parametrize(
    ("history_ids", "expected"),
    [
        ([], [2.0, 1.5, -1.0, 0.0]),
        ([0], [1.0, 1.5, -1.0, 0.0]),  # positive logit: divided
        ([2], [2.0, 1.5, -2.0, 0.0]),  # negative logit: multiplied
        ([3], [2.0, 1.5, -1.0, 0.0]),  # zero stays zero
        ([0, 0, 0], [1.0, 1.5, -1.0, 0.0]),  # a repeated id is penalised once
        ([1, 2, 0], [1.0, 0.75, -2.0, 0.0]),
    ],
)
def test_repetition_penalty_semantics(history_ids: list[int], expected: list[float]) -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0, 0.0]])  # [1, 4]
    penalised = apply_repetition_penalty(logits, history_ids, [], penalty=2.0)
    assert penalised.tolist() == [expected]


def test_repetition_penalty_position_sees_drafts_before_it() -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0, 0.5]]).repeat(4, 1)  # [4, 4]
    # history [3]; drafts [0, 2, 1]: row i sees history + drafts[:i].
    penalised = apply_repetition_penalty(logits, [3], [0, 2, 1], penalty=2.0)
    assert penalised.tolist() == [
        [2.0, 1.5, -1.0, 0.25],
        [1.0, 1.5, -1.0, 0.25],
        [1.0, 1.5, -2.0, 0.25],
        [1.0, 0.75, -2.0, 0.25],
    ]
    # n drafts for n rows: the draft after the last row changes nothing.
    assert torch.equal(apply_repetition_penalty(logits, [3], [0, 2, 1, 1], penalty=2.0), penalised)
    assert logits[0, 0] == 2.0  # input untouched


def test_repetition_penalty_changes_greedy_argmax() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.2, -3.0]]).repeat(3, 1)  # [3, 4]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert process_logits(logits, [], [0, 1], params).argmax(-1).tolist() == [0, 1, 2]
    assert process_logits(logits, [0], [1, 3], params).argmax(-1).tolist() == [1, 2, 2]
    without_penalty = SamplingParams(temperature=0.0)
    assert process_logits(logits, [0], [1, 3], without_penalty).argmax(-1).tolist() == [0, 0, 0]


# Probabilities (0.4, 0.3, 0.2, 0.1) as logits; each case: kept token ids.
_PROBS = [0.4, 0.3, 0.2, 0.1]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "kept_ids"),
    [
        (1.0, -1, 1.0, [0, 1, 2, 3]),
        (1.0, 1, 1.0, [0]),
        (1.0, 2, 1.0, [0, 1]),
        (1.0, 3, 1.0, [0, 1, 2]),
        (1.0, 10, 1.0, [0, 1, 2, 3]),  # k larger than the vocabulary
        (1.0, -1, 0.3, [0]),
        (1.0, -1, 0.65, [0, 1]),
        (1.0, -1, 0.75, [0, 1, 2]),
        (1.0, -1, 0.95, [0, 1, 2, 3]),
        (1.0, -1, 1e-6, [0]),  # always at least one token
        (1.0, 2, 0.5, [0]),  # top-p after top-k: (0.57, 0.43) renormalised
        (1.0, 3, 0.8, [0, 1, 2]),  # (0.44, 0.33, 0.22): 0.78 < 0.8
        (0.5, -1, 0.8, [0, 1]),  # temperature first: (0.53, 0.30, 0.13, 0.03)
        (2.0, -1, 0.8, [0, 1, 2]),
    ],
)
def test_top_k_top_p_masks(temperature: float, top_k: int, top_p: float, kept_ids: list[int]) -> None:
    # Shuffle the vocabulary so the masks cannot rely on the order of ids.
    permutation = [2, 0, 3, 1]  # position j holds token permutation[j]
    logits = torch.tensor([[math.log(_PROBS[token_id]) for token_id in permutation]])  # [1, 4]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    processed = process_logits(logits, [], [], params)  # [1, 4]
    kept = sorted(permutation[j] for j in range(4) if processed[0, j] != NEG_INF)
    assert kept == kept_ids
    for j in range(4):
        if processed[0, j] != NEG_INF:
            assert processed[0, j].item() == pytest.approx(logits[0, j].item() / temperature, rel=1e-6)


def test_masks_apply_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])  # [2, 4]
    processed = process_logits(logits, [], [7], SamplingParams(top_k=2))
    assert (processed != NEG_INF).tolist() == [[True, True, False, False], [False, False, True, True]]


def test_greedy_skips_temperature_and_masks() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, top_k=1, top_p=0.1)
    assert torch.equal(process_logits(logits, [], [], params), logits)


def test_large_vocab_half_precision_input() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50_000, generator=generator).to(torch.bfloat16)  # [5, 50000]
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.2)
    processed = process_logits(logits, list(range(0, 50_000, 7)), [1, 2, 3, 4], params)
    assert processed.dtype == torch.float32 and processed.shape == (5, 50_000)
    num_kept = (processed != NEG_INF).sum(-1)
    assert bool(((num_kept >= 1) & (num_kept <= 50)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax(dtype: torch.dtype) -> None:
    # numpy on the CPU for float32 / 64 (torch's CPU argmax is ~15x slower there), torch's
    # own elsewhere: the same indices either way, ties and NaNs included.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 49152, generator=generator).to(dtype)
    logits[1, 7] = logits[1, 9000] = logits[1].max() + 1  # a tie: the first index
    logits[2, 123] = float("nan")                         # a NaN is the maximum
    logits[2, 456] = float("nan")
    logits[3] = float("-inf")                             # every logit -inf: index 0
    logits[4, 49151] = float("inf")
    expected = logits.argmax(dim=-1)
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.tolist() == expected.tolist()
    assert got[1] == 7 and got[2] == 123 and got[3] == 0 and got[4] == 49151
    strided = logits[::2, ::3]  # a view that is not contiguous
    assert argmax_rows(strided).tolist() == strided.argmax(dim=-1).tolist()
    assert argmax_rows(logits[5]).item() == logits[5].argmax().item()  # one row, 1-D


@pytest.mark.parametrize(("min_p", "kept_ids"),
                         [(0.0, [0, 1, 2, 3]), (0.3, [0, 1]), (0.5, [0, 1]), (0.6, [0]), (1.0, [0])])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top(min_p: float, kept_ids: list[int]) -> None:
    # probs 0.5, 0.25, 0.125, 0.125 at temperature 1: min_p=0.3 keeps those >= 0.15; a
    # probability equal to the threshold stays (vLLM drops only those below it).
    logits = torch.tensor([[math.log(4.0), math.log(2.0), 0.0, 0.0]])
    processed = process_logits(logits, [], [], SamplingParams(temperature=1.0, min_p=min_p))
    assert torch.isfinite(processed[0]).nonzero().flatten().tolist() == kept_ids


def test_min_p_applies_after_temperature() -> None:
    # At temperature 0.5 the weights sharpen to 16:4:1:1, so min_p=0.2 keeps 4/16 and drops
    # 1/16; at temperature 2 they flatten to 2:1.41:1:1 and everything stays.
    logits = torch.tensor([[math.log(4.0), math.log(2.0), 0.0, 0.0]])
    sharp = process_logits(logits, [], [], SamplingParams(temperature=0.5, min_p=0.2))
    flat = process_logits(logits, [], [], SamplingParams(temperature=2.0, min_p=0.2))
    assert torch.isfinite(sharp[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(flat[0]).all()


def test_logit_bias_comes_before_the_repetition_penalty() -> None:
    # vLLM's order: the bias turns logit -1 into +1, which the penalty of 2 then halves.
    logits = torch.tensor([[-1.0, 0.0]])
    processed = process_logits(logits, [0], [], SamplingParams(temperature=0.0, repetition_penalty=2.0,
                                                               logit_bias={0: 2.0}))
    assert processed[0].tolist() == [0.5, 0.0]


def test_greedy_ignores_min_p_but_not_logit_bias() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0]])
    processed = process_logits(logits, [], [], SamplingParams(temperature=0.0, min_p=0.9, logit_bias={2: 5.0}))
    assert processed[0].tolist() == [3.0, 1.0, 5.0]
