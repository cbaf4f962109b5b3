"""How long a prefill chunk may be in a step that also decodes, from measured step times.

A running decode waits for the whole step, so the step's length is its time between tokens.
A token cap (`long_prefill_token_threshold`) bounds the step in tokens, but what a token of
prefill costs differs by device and model by orders of magnitude: on an accelerator
hundreds of prompt tokens run in about a decode step's time, while a CPU computes each at
~3 ms for 135M, so any fixed cap is either too small for one or far too large for the
other. The pacer sizes chunks in time instead: a step that decodes may take about
`decode_steps` times a plain decode step, so it prefills

    (decode_steps - 1) * decode_step_s / prefill_token_s

tokens, within [MIN_PACED_CHUNK, the token cap]. Both costs are measured on the steps this
engine runs (moving averages): `decode_step_s` on steps with no prefill, `prefill_token_s`
as what a step's prefill tokens added to it. Load from other processes slows both alike,
so the chunk it gives depends on their ratio, not on the machine's mood. Until both are
measured the token cap alone applies.

The chunking this chooses never changes an answer: outputs are the same however a prompt
is chunked (the determinism rules of docs/architecture.md), so a pacer that chunks
differently from run to run only moves time between requests.
"""

from __future__ import annotations

from dataclasses import dataclass

# The smallest chunk the pacer gives: below it a prompt's prefill spends most of each step
# on the step's fixed costs (the weights' read, the scheduling), and a long prompt would
# take hundreds of steps more for little gain in the decodes' pace.
MIN_PACED_CHUNK = 8
# Weight of the newest sample in the moving averages: about the last five steps count.
EMA_WEIGHT = 0.2


@dataclass(slots=True)
class PrefillPacer:
    """Measured step costs, and the chunk a decoding step may prefill (see the module)."""

    # A step that decodes may take about this many plain decode steps (0: pace off, the
    # token cap alone applies).
    decode_steps: float
    decode_step_s: float | None = None
    prefill_token_s: float | None = None

    def observe(self, seconds: float, num_prefill_tokens: int, decoded: bool) -> None:
        """One step's wall time, its prompt tokens, and whether it also ran decodes."""
        if seconds <= 0 or not (num_prefill_tokens or decoded):
            return
        if num_prefill_tokens == 0:
            self.decode_step_s = _moving_average(self.decode_step_s, seconds)
            return
        # A step of prefill alone has no decode part; one beside decodes paid for them too.
        base = self.decode_step_s if decoded and self.decode_step_s is not None else 0.0
        added = max(seconds - base, 0.0) / num_prefill_tokens
        self.prefill_token_s = _moving_average(self.prefill_token_s, added)

    def max_chunk(self, token_cap: int) -> int:
        """The longest prefill chunk of a step that decodes; `token_cap` bounds it (> 0)."""
        if (self.decode_steps <= 0 or self.decode_step_s is None
                or not self.prefill_token_s):
            return token_cap
        paced = int((self.decode_steps - 1) * self.decode_step_s / self.prefill_token_s)
        return max(min(paced, token_cap), min(MIN_PACED_CHUNK, token_cap))


def _moving_average(current: float | None, sample: float) -> float:
    return sample if current is None else current + EMA_WEIGHT * (sample - current)
