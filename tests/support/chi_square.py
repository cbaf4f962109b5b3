"""Pearson's chi-square goodness-of-fit test, for the samplers' statistical tests."""

from __future__ import annotations

import torch
from torch import Tensor


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
