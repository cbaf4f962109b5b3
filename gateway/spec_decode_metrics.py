"""vLLM's per-request speculative decoding metrics (`--per-request-spec-decode-metrics`),
in vLLM's field names and place: a response's top-level `"metrics": {"speculative_decoding":
{...}}`, and in a stream the last chunk, the one with the usage.

`summary` gives vLLM's aggregates, all derived from the request's counters:
`num_spec_steps`, `num_draft_tokens`, `num_accepted_draft_tokens`, `mean_acceptance_length`
(1 + accepted / steps), `draft_acceptance_rate` (accepted / drafted) and
`acceptance_histogram` (entry j: verify steps that accepted exactly j draft tokens, j = 0..k).
`detailed` (vLLM's per-step lists) is refused: the verifier keeps no per-step record.
`usage.speculation` carries specdec's own figures either way.
"""

from __future__ import annotations

from specdec.errors import ConfigError
from specdec.v1 import specdec_pb2

# vLLM's choices for the flag (gateway.app.GatewayConfig), and those served.
MODES = ("none", "summary", "detailed")
SUPPORTED_MODES = ("none", "summary")


def check_mode(mode: str) -> str:
    if mode not in SUPPORTED_MODES:
        raise ConfigError(f"--per-request-spec-decode-metrics {mode!r} is not supported: "
                          f"specdec keeps no per-step record; use one of "
                          f"{', '.join(SUPPORTED_MODES)}", param="per_request_spec_decode_metrics")
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


def metrics_body(mode: str, stats: specdec_pb2.SpeculationStats | None,
                 num_speculative_tokens: int) -> dict | None:
    """The response's `metrics` object for `mode`; None when it has none ("none")."""
    if mode == "none":
        return None
    stats = stats or specdec_pb2.SpeculationStats()
    steps, drafted, accepted = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
    return {"speculative_decoding": {
        "num_spec_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_draft_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": acceptance_histogram(stats, num_speculative_tokens),
    }}
