"""Why a speculation plan drafts nothing, in the figures it measured: the text each
sequence's `SpeculationCounters` carries (SpeculationPolicy.off_reasons), as a whole step's
reason when nobody drafts, else as one request's."""

from __future__ import annotations

from verifier_svc.speculation.candidate import Candidate
from verifier_svc.speculation.draft_allocation import CandidateOutlook, DraftAllocation, StepPrices
from verifier_svc.speculation.realized import RealizedThroughput


def step_off_reason(realized: RealizedThroughput, candidates: list[Candidate], prices: StepPrices,
                    outlook: CandidateOutlook, allocation: DraftAllocation) -> str:
    """Why a plan drafts nothing: what drafting steps realized at this batch size when they
    are why, else what the plan expected."""
    num_seqs = len(candidates)
    efficiency = realized.efficiency(num_seqs)
    if efficiency is not None and efficiency < 1.0 and realized.cost_scale(num_seqs) > 1.0:
        return (f"off: drafting yields {efficiency:.2f}x plain decoding at batch size "
                f"{num_seqs}")
    if allocation.longest:
        planned_speedup = ((allocation.expected_tokens / allocation.seconds)
                           / (prices.plain_tokens / prices.plain_seconds))
        return (f"off: drafting would yield {planned_speedup:.2f}x plain decoding at batch "
                f"size {num_seqs}")
    best_first_gain = max((outlook.first_gain(index) for index, candidate in enumerate(candidates)
                           if candidate.max_tokens > 0), default=0.0)
    draft_cost_in_tokens = ((prices.verify_slope + prices.verify_per_seq)
                            * prices.plain_tokens / prices.plain_seconds)
    return (f"off: a draft is expected to add at most {best_first_gain:.2f} tokens; "
            f"verifying it takes the time of {draft_cost_in_tokens:.2f} tokens at batch "
            f"size {num_seqs}")


def request_off_reason(first_gain: float, num_seqs: int) -> str:
    """Why one request gets no draft on a step where others draft."""
    return (f"off for this request: a draft is expected to add {first_gain:.2f} tokens, less "
            f"than it costs at batch size {num_seqs}")
