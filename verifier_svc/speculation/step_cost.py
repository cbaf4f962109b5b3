"""What a step costs, fit online: the verify step's time against the tokens it verifies and
the sequences with drafts, the drafter's time against the longest draft asked, and what a
sequence's first ask adds to it (used by verifier_svc/speculation/policy.py).

Both are exponentially weighted least-squares fits with a weak prior, so that a few
observations at one size give a sane model, and both cap a timing at SPIKE_FACTOR times
their prediction (one spike is a bounded slowdown; a lasting one is still learnt).

The fits give the shape of a cost (what a row, a sequence, a drafted token adds); its level
is the machine's quiet speed (QuietSpeed): the fit scaled down to a low quantile of recent
timings over its own prediction for the same counted work. Another process's load lands as
scheduling delays, some steps hit and some not, and far more on the drafter's round trip
(another process, woken per ask) than on the verify step; a mean takes them in unevenly and
prices drafting out on a busy machine, while the steps that ran undisturbed show what the
work costs on both sides alike.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

# The cost model's prior: a forward over PRIOR_FLAT_TOKENS tokens costs twice a
# one-token forward.
PRIOR_FLAT_TOKENS = 32
COST_DECAY = 0.98
# A timing above SPIKE_FACTOR times the model's prediction is counted as that much: the
# first call of a new shape, a garbage collection or a neighbour's burst is not what the
# next step costs, and a mean that swallowed one would, for the drafter, stop the drafting
# whose timings could correct it. A lasting slowdown still gets in, a factor per timing.
SPIKE_FACTOR = 3.0
# The quiet speed: the QUIET_QUANTILE of the last QUIET_WINDOW timings over the fit's
# prediction for their work, once QUIET_MIN_TIMINGS were seen.
QUIET_QUANTILE = 0.1
QUIET_WINDOW = 64
QUIET_MIN_TIMINGS = 2
# The fit takes a timing at most QUIET_SLACK times its quiet prediction: the delays of a
# loaded step are noise about the work's cost, and one delayed step at an unusual size
# (a probe's two rows among one-row steps) would otherwise set the fit's slope.
QUIET_SLACK = 1.5


class QuietSpeed:
    """The recent timings with their counted work, and what share of the fit's prediction
    the quiet ones took: the factor that turns a fit taken over loaded and quiet steps alike
    into the machine's quiet cost. Above 1 once nearly every recent timing ran over the fit:
    a lasting slowdown (more context, a slower drafter) is learnt within a window."""

    def __init__(self) -> None:
        self._timings: deque[tuple[tuple[float, ...], float]] = deque(maxlen=QUIET_WINDOW)

    def observe(self, features: tuple[float, ...], seconds: float) -> None:
        self._timings.append((features, seconds))

    def factor(self, predict: Callable[[tuple[float, ...]], float]) -> float:
        """The low quantile of timing / predict(work) over the window (1 with too few)."""
        if len(self._timings) < QUIET_MIN_TIMINGS:
            return 1.0
        ratios = sorted(seconds / predicted for features, seconds in self._timings
                        if (predicted := predict(features)) > 0.0)
        if len(ratios) < QUIET_MIN_TIMINGS:
            return 1.0
        return ratios[int(QUIET_QUANTILE * (len(ratios) - 1))]


class LinearCostModel:
    """seconds = base + slope * x, fit by exponentially weighted least squares.

    While the observed x are too alike to give a slope, `prior_slope_fraction * base`
    stands in. `fit()` is at the quiet speed (QuietSpeed); `mean_fit()` the fit itself.
    """

    def __init__(self, prior_slope_fraction: float, decay: float = COST_DECAY) -> None:
        self.prior_slope_fraction = prior_slope_fraction
        self.decay = decay
        self._sums = [0.0] * 5  # weight, x, y, x*x, x*y
        self._mean_fitted: tuple[float, float] | None = None  # mean_fit() until the next observe
        self._fitted: tuple[float, float] | None = None  # fit() until the next observe
        self.quiet = QuietSpeed()

    def observe(self, x: float, seconds: float) -> None:
        self.quiet.observe((x,), seconds)
        if self.has_data:
            base, slope = self.mean_fit()
            quiet_base, quiet_slope = self.fit()
            seconds = min(seconds, SPIKE_FACTOR * (base + slope * x),
                          QUIET_SLACK * (quiet_base + quiet_slope * x))
        decayed = [value * self.decay for value in self._sums]
        self._sums = [decayed[0] + 1.0, decayed[1] + x, decayed[2] + seconds,
                      decayed[3] + x * x, decayed[4] + x * seconds]
        self._mean_fitted = self._fitted = None

    @property
    def has_data(self) -> bool:
        return self._sums[0] > 0.0

    def fit(self) -> tuple[float, float]:
        """(base, slope) at the machine's quiet speed; with no data (0, 0)."""
        if self._fitted is None:
            base, slope = self.mean_fit()
            factor = self.quiet.factor(lambda features: base + slope * features[0])
            self._fitted = (base * factor, slope * factor)
        return self._fitted

    def mean_fit(self) -> tuple[float, float]:
        """(base, slope) of the timings as they came, load included; with no data (0, 0)."""
        if self._mean_fitted is None:
            self._mean_fitted = self._solve()
        return self._mean_fitted

    def _solve(self) -> tuple[float, float]:
        prior_slope_fraction = self.prior_slope_fraction
        weight, sum_x, sum_y, sum_xx, sum_xy = self._sums
        if weight == 0.0:
            return 0.0, 0.0
        mean_x, mean_y = sum_x / weight, sum_y / weight
        variance_x = sum_xx / weight - mean_x * mean_x
        if variance_x > 0.25:  # x varied by more than about one token
            slope = max(0.0, (sum_xy / weight - mean_x * mean_y) / variance_x)
            base = max(0.0, mean_y - slope * mean_x)
            return base, slope
        base = mean_y / (1.0 + prior_slope_fraction * mean_x)
        return base, base * prior_slope_fraction


class FirstAskCost:
    """What a sequence's first ask adds to a drafter round trip: the median, over the last
    WINDOW round trips that carried first asks, of their time beyond a steady round trip per
    first ask. A median, not a fit: first asks come about once a request, so one slow round
    trip (the drafter's first call after start-up took ~5x the next ones) would sway a
    decaying mean for the rest of a run."""

    WINDOW = 32

    def __init__(self) -> None:
        self._extra_per_first_ask: deque[float] = deque(maxlen=self.WINDOW)

    def observe(self, num_first_asks: int, seconds: float, steady_seconds: float) -> None:
        self._extra_per_first_ask.append(max(0.0, seconds - steady_seconds) / num_first_asks)

    @property
    def has_data(self) -> bool:
        return bool(self._extra_per_first_ask)

    def per_first_ask(self) -> float:
        """Seconds; 0 with no data."""
        return statistics.median(self._extra_per_first_ask) if self._extra_per_first_ask else 0.0


class VerifyCostModel:
    """seconds = base + per_token * N + per_drafting_seq * S for a step verifying N tokens of
    which S sequences carry drafts, fit by exponentially weighted least squares.

    The per-sequence term is what a sequence's first draft costs beyond its tokens (its
    attention takes the multi-row, masked path; the sampler walks its drafts). A weak prior
    (`PRIOR_OBSERVATIONS` pseudo-observations: a forward over PRIOR_FLAT_TOKENS tokens costs
    twice a one-token forward, no per-sequence term) keeps the fit sane while N and S have
    hardly varied. `fit()` is at the quiet speed (QuietSpeed); `mean_fit()` the fit itself.
    """

    PRIOR_OBSERVATIONS = 2.0

    def __init__(self, decay: float = COST_DECAY) -> None:
        self.decay = decay
        # Plain floats, not tensors: observe and fit run every step, and a 3x3 system in
        # torch cost ~0.2 ms a step in op dispatch (a few us in Python).
        self._gram = [[0.0] * 3 for _ in range(3)]  # sum of f f^T, f = (1, N, S)
        self._moment = [0.0] * 3                    # sum of f * seconds
        self._mean_fitted: tuple[float, float, float] | None = None  # until the next observe
        self._fitted: tuple[float, float, float] | None = None  # fit() until the next observe
        self.quiet = QuietSpeed()

    def observe(self, num_tokens: int, num_drafting_seqs: int, seconds: float) -> None:
        self.quiet.observe((float(num_tokens), float(num_drafting_seqs)), seconds)
        if self.has_data:
            base, per_token, per_seq = self.mean_fit()
            quiet_base, quiet_per_token, quiet_per_seq = self.fit()
            seconds = min(seconds, SPIKE_FACTOR * (base + per_token * num_tokens
                                                   + per_seq * num_drafting_seqs),
                          QUIET_SLACK * (quiet_base + quiet_per_token * num_tokens
                                         + quiet_per_seq * num_drafting_seqs))
        features = (1.0, float(num_tokens), float(num_drafting_seqs))
        decay = self.decay
        for i, row in enumerate(self._gram):
            for j in range(3):
                row[j] = row[j] * decay + features[i] * features[j]
            self._moment[i] = self._moment[i] * decay + features[i] * seconds
        self._mean_fitted = self._fitted = None

    @property
    def has_data(self) -> bool:
        return self._gram[0][0] > 0

    def fit(self) -> tuple[float, float, float]:
        """(base, per_token, per_drafting_seq) at the machine's quiet speed, none negative;
        zeros with no data."""
        if self._fitted is None:
            base, per_token, per_seq = self.mean_fit()
            factor = self.quiet.factor(
                lambda features: base + per_token * features[0] + per_seq * features[1])
            self._fitted = (base * factor, per_token * factor, per_seq * factor)
        return self._fitted

    def mean_fit(self) -> tuple[float, float, float]:
        """(base, per_token, per_drafting_seq) of the timings as they came, load included."""
        if self._mean_fitted is None:
            self._mean_fitted = self._solve()
        return self._mean_fitted

    def _solve(self) -> tuple[float, float, float]:
        gram, moment = self._gram, self._moment
        weight = gram[0][0]
        if weight == 0.0:
            return 0.0, 0.0, 0.0
        means = [value / weight for value in gram[0]]  # (1, mean N, mean S)
        mean_seconds = moment[0] / weight
        prior_base = mean_seconds / (1.0 + means[1] / PRIOR_FLAT_TOKENS)
        prior = (prior_base, prior_base / PRIOR_FLAT_TOKENS, 0.0)
        # Ridge toward the prior, each slope weighted by its feature's variance (plus a
        # quarter, so the prior decides while a feature has not varied); the base is free.
        penalty = [self.PRIOR_OBSERVATIONS * 1e-9] + [
            self.PRIOR_OBSERVATIONS * (max(0.0, gram[i][i] / weight - means[i] * means[i]) + 0.25)
            for i in (1, 2)]
        matrix = [[gram[i][j] + (penalty[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        rhs = [moment[i] + penalty[i] * prior[i] for i in range(3)]
        base, per_token, per_seq = (max(0.0, value) for value in _solve_linear(matrix, rhs))
        return base, per_token, per_seq


def _solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """x with matrix @ x = rhs for a 3 x 3 system, by Cramer's rule (the ridge keeps the
    matrix positive definite and well conditioned; written out, as the fit runs every step:
    ~1 us against ~9 us for an elimination's Python loops)."""
    (a, b, c), (d, e, f), (g, h, i) = matrix
    r0, r1, r2 = rhs
    minor_ei = e * i - f * h
    minor_di = d * i - f * g
    minor_dh = d * h - e * g
    det = a * minor_ei - b * minor_di + c * minor_dh
    x0 = (r0 * minor_ei - b * (r1 * i - f * r2) + c * (r1 * h - e * r2)) / det
    x1 = (a * (r1 * i - f * r2) - r0 * minor_di + c * (d * r2 - r1 * g)) / det
    x2 = (a * (e * r2 - r1 * h) - b * (d * r2 - r1 * g) + r0 * minor_dh) / det
    return [x0, x1, x2]
