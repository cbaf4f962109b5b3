"""A sequence: one request's tokens, its place in the KV cache and its counters.

Terms: `token_ids` is the prompt followed by the output so far. `num_computed_tokens`
counts the leading tokens whose K/V are in the cache; the tokens after it are the ones
the next forward must run. A running sequence in decode has exactly one uncomputed
token (the last one sampled); a sequence in prefill (or recomputing after preemption)
has more.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.engine.position_random import PositionRandom
from specdec.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True)
class SpeculationCounters:
    """vLLM's spec-decode counters, per request or per engine."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Tokens a grammar forced (its only continuation), verified without a drafter; not
    # counted as drafts above.
    num_forced_tokens: int = 0
    # Per request: why the speculation policy last planned no draft for it, with the
    # figures it measured ("" while it drafts; see SpeculationPolicy.off_reasons).
    policy: str = ""
    # Per request: the policy's state when it last decided, one of
    # verifier_svc/speculation/policy.py's POLICY_STATES ("" when no adaptive policy decides).
    policy_state: str = ""
    # Per request: (draft tokens checked, accepted) of each drafting step, in order (vLLM's
    # detailed per-request metrics); None for the engine's totals, which would only grow.
    steps: list[tuple[int, int]] | None = None

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend(
                [0] * (num_draft_tokens - len(self.accepted_per_position)))
        for position in range(num_accepted_tokens):
            self.accepted_per_position[position] += 1
        if self.steps is not None:
            self.steps.append((num_draft_tokens, num_accepted_tokens))


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    # Most draft tokens to verify per step for this request (0: no speculation).
    max_speculative_tokens: int
    # A seeded request's random stream (per output position); None: torch's default one.
    generator: PositionRandom | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix caching (specdec/engine/block_manager.py): the hashes of the full blocks of
    # token_ids so far, and how many leading blocks of block_table are registered.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # vLLM's cache_salt: prefix-cache blocks are shared only between equal salts.
    cache_salt: str = ""
    # Prompt tokens whose KV came from the prefix cache at the sequence's first admission.
    num_cached_tokens: int = 0
    # Whether a prefix-cache hit may skip the prefix's forward (not when a drafter needs
    # the target's hidden states of every position).
    may_reuse_prefix: bool = True
    # The request's structured-output constraint (verifier_svc.grammar.GrammarState),
    # advanced by verified tokens only; None: unconstrained.
    grammar: Any = None
    # This step's grammar-forced draft (set when the step is planned).
    forced_draft: list[int] = field(default_factory=list)
    # Accepted tokens of the last draft, reported to the drafter so it can roll back.
    num_last_accepted: int = 0
    # Times the drafter was asked for this sequence (its first ask carries the whole context).
    num_drafter_calls: int = 0
    # Output tokens that ended the sequence but are not streamed (EOS, stop ids).
    num_hidden_output_tokens: int = 0
    spec: SpeculationCounters = field(default_factory=lambda: SpeculationCounters(steps=[]))
    # Target hidden states the drafter needs, row t for context position t,
    # [prompt_len + max_tokens, width]; valid up to num_computed_tokens. None when not
    # captured (no drafter needs them, or the sequence began before one said so).
    hidden_states: torch.Tensor | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
