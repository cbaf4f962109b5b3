"""vLLM's per-request speculative decoding metrics (`--per-request-spec-decode-metrics`),
in vLLM's field names and place: a response's top-level `"metrics": {"speculative_decoding":
{...}}`, and in a stream the last chunk, the one with the usage.

`summary` gives vLLM's aggregates, all derived from the request's counters:
`num_spec_steps`, `num_draft_tokens`, `num_accepted_draft_tokens`, `mean_acceptance_length`
(1 + accepted / steps), `draft_acceptance_rate` (accepted / drafted),
`acceptance_histogram` (entry j: verify steps that accepted exactly j draft tokens, j = 0..k)
and `num_spec_tokens` (k). `detailed` adds `per_step_drafted` and `per_step_accepted`, one
entry per verify step with drafts, in order (the gateway asks the verifier to record them).
As in vLLM, `speculative_decoding` is null for n > 1 and on a server without speculation.
`usage.speculation` carries specdec's own figures either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.errors import ConfigError
from specdec.v1 import specdec_pb2

if TYPE_CHECKING:
    from gateway.generation import GenerationResult

# The flag's choices (gateway.config.GatewayConfig.per_request_spec_decode_metrics).
MODES = ("none", "summary", "detailed")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"--per-request-spec-decode-metrics {mode!r} is not one of "
                          f"{', '.join(MODES)}", param="per_request_spec_decode_metrics")
    return mode


def acceptance_histogram(stats: specdec_pb2.SpeculationStats, num_speculative_tokens: int,
                         ) -> list[int]:
    """Verify steps by how many draft tokens they accepted (0..k). A step that accepted j
    tokens accepted each position before j, so accepted_per_position[i] counts the steps
    that accepted at least i + 1."""
    at_least = [stats.num_drafts, *stats.accepted_per_position]
    k = max(num_speculative_tokens, len(at_least) - 1)
    at_least += [0] * (k + 2 - len(at_least))
    return [at_least[j] - at_least[j + 1] for j in range(k + 1)]


def metrics_body(mode: str, results: list[GenerationResult], num_speculative_tokens: int,
                 ) -> dict | None:
    """The response's `metrics` object for `mode` and the request's choices; None when it
    has none ("none")."""
    if mode == "none":
        return None
    if len(results) != 1 or num_speculative_tokens == 0:
        return {"speculative_decoding": None}
    result = results[0]
    stats = result.speculation or specdec_pb2.SpeculationStats()
    steps, drafted, accepted = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
    summary = {
        "num_spec_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": acceptance_histogram(stats, num_speculative_tokens),
        "num_spec_tokens": num_speculative_tokens,
    }
    if mode == "detailed":
        summary["per_step_drafted"] = [num_drafted for num_drafted, _ in result.steps]
        summary["per_step_accepted"] = [num_accepted for _, num_accepted in result.steps]
    return {"speculative_decoding": summary}
