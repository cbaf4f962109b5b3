"""The one shape every drafting method has, and the ngram method behind it.

A `Proposer` owns per-sequence drafting state for ONE verifier stream: the token
history for ngram, a draft KV cache for draft_model / eagle / eagle3. The verified
context is authoritative: the drafter appends only what the verifier sends, never its
own drafts, so after each step its history equals the verifier's context.

Terms: a draft is up to k proposed tokens; *accepted* tokens are the leading draft
tokens the target agreed with (Leviathan et al. 2023). Model methods use
`num_accepted_tokens` to roll their draft KV back to the verified context; ngram keeps
no draft state, so for it rollback is a no-op.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from drafter_svc.ngram_proposer import NgramProposer
from specdec.config import SpeculativeConfig
from specdec.config_flags import flag
from specdec.errors import ConfigError

if TYPE_CHECKING:  # torch is imported only by methods that run a model
    import torch

logger = logging.getLogger(__name__)

# The ngram method's longest context when neither --max-model-len nor a target model
# directory says: the default model's (SmolLM2's max_position_embeddings).
DEFAULT_NGRAM_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class ProposerInfo:
    """What GetInfo reports about a method."""

    method: str
    max_num_speculative_tokens: int
    # Target layers whose hidden states the method needs; -1 = final normed state.
    hidden_state_layer_ids: tuple[int, ...] = ()
    # 0 / "" when the method does not depend on the vocabulary / tokenizer.
    vocab_size: int = 0
    tokenizer_fingerprint: str = ""
    # Columns of SequenceUpdate.hidden_states (all layers asked for, concatenated); not in
    # GetInfo: the servicer checks incoming rows against it. 0 when no states are needed.
    hidden_state_width: int = 0
    # Longest context the method accepts and drafts for (not in GetInfo: the servicer
    # refuses to hold longer ones); 0 = not given, the servicer's default applies.
    max_model_len: int = 0
    # The method learns across requests: the verifier sends it every finished output
    # (ProposeRequest.finished_outputs), which the servicer hands to `LearningProposer.learn`.
    wants_finished_outputs: bool = False


@dataclass(slots=True)
class Proposal:
    draft_token_ids: list[int]
    # [len(draft_token_ids), vocab_size]; None for greedy (one-hot) drafts.
    draft_probs: torch.Tensor | None = None
    # One per draft token in [0, 1] (drafter_svc/confidence.py), or None: the method has none.
    confidence: list[float] | None = None
    # A tree draft's parents (SequenceDraft.draft_parents), or None: a flat draft.
    parents: list[int] | None = None


class Proposer(Protocol):
    """Per-stream drafting state plus the method's batched `propose`."""

    info: ProposerInfo

    def context_len(self, seq_id: int) -> int | None:
        """Tokens held for seq_id, or None when the sequence is unknown."""
        ...

    def add_sequence(self, seq_id: int) -> None:
        """Starts (or restarts, dropping old state) an empty sequence."""
        ...

    def append_tokens(self, seq_id: int, token_ids: Sequence[int],
                      hidden_states: torch.Tensor | None) -> None:
        """Appends verified tokens (and their target hidden states, when the method needs them)."""
        ...

    def rollback(self, seq_id: int, num_accepted_tokens: int) -> None:
        """Discards draft state past the accepted part of the previous draft."""
        ...

    def remove_sequence(self, seq_id: int) -> None:
        """Drops all state of seq_id; unknown ids are ignored."""
        ...

    def propose(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[Proposal]:
        """One proposal per seq_id, at most num_tokens[i] (and max k) tokens each."""
        ...

    def close(self) -> None:
        """The stream ended: releases shared resources (draft KV blocks) held for it."""
        ...


class LearningProposer(Proposer, Protocol):
    """A method that drafts from earlier requests' outputs (info.wants_finished_outputs)."""

    def learn(self, output_id: int, prompt_token_ids: Sequence[int],
              output_token_ids: Sequence[int]) -> None:
        """A request finished on some replica of this drafter: its output (and the prompt's
        tail) becomes a draft source. `output_id` identifies the output across replays: one
        already held is not counted twice."""
        ...


@dataclass(frozen=True)
class ModelOptions:
    """Drafter flags for the model methods (draft_model, eagle, eagle3); ngram reads only
    target_model (for its vocabulary and length) and max_model_len."""

    # The target the drafts are for: eagle heads borrow its embedding and lm_head and
    # report its tokenizer; eagle3 derives its default layer ids from its depth.
    # specdec.models.DEFAULT_MODEL, spelled out: importing it would pull in torch.
    target_model: str = field(default="smollm2-135m-instruct", metadata=flag(
        "the verifier's model (eagle / eagle3 borrow its embedding and lm_head and report its "
        "tokenizer)"))
    dtype: str = field(default="auto", metadata=flag(
        "draft model dtype: auto (float32 on cpu, bfloat16 on accelerators), float32, "
        "bfloat16, float16"))
    device: str = field(default="auto", metadata=flag("auto, cpu, cuda or npu"))
    # The draft KV pool, shared by all streams: num_blocks x block_size token slots.
    num_blocks: int = field(default=512, metadata=flag(
        "draft KV cache blocks shared by all streams"))
    block_size: int = field(default=16, metadata=flag("tokens per draft KV block"))
    # Longest context accepted and drafted for (RoPE table size); None: the model's
    # max_position_embeddings (ngram: the target's, else DEFAULT_NGRAM_MAX_MODEL_LEN).
    max_model_len: int | None = field(default=None, metadata=flag(
        "longest context held and drafted for; longer ones get no drafts (default: the "
        "model's maximum; ngram: the --target-model directory's, else 8192)"))
    # Sample drafts from the draft distribution and send it as draft_probs (default: greedy).
    draft_sampling: bool = field(default=False, metadata=flag(
        "sample drafts and send their probabilities (default: greedy drafts)"))
    seed: int = field(default=0, metadata=flag("seed for --draft-sampling"))

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}",
                                  param=name)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1, got {self.max_model_len}",
                              param="max_model_len")


class TokenHistory:
    """A growing int32 token array with amortised O(1) appends (capacity doubles).

    int32 halves the memory of int64: the servicer refuses ids of 2**31 and above.
    """

    __slots__ = ("_buffer", "_length")

    def __init__(self, initial_capacity: int = 256) -> None:
        self._buffer = np.empty(max(initial_capacity, 16), dtype=np.int32)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def extend(self, token_ids: Sequence[int]) -> None:
        num_new = len(token_ids)
        if num_new == 0:
            return
        needed = self._length + num_new
        if needed > self._buffer.shape[0]:
            grown = np.empty(max(needed, 2 * self._buffer.shape[0]), dtype=np.int32)
            grown[:self._length] = self._buffer[:self._length]
            self._buffer = grown
        self._buffer[self._length:needed] = token_ids
        self._length = needed

    def view(self) -> np.ndarray:
        """The tokens so far, without copying; valid until the next extend."""
        return self._buffer[:self._length]


@dataclass(slots=True)
class NgramMethod:
    """The ngram method as a `Proposer`: per-sequence state is the token history only."""

    proposer: NgramProposer
    info: ProposerInfo
    _histories: dict[int, TokenHistory] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: SpeculativeConfig,
                    options: ModelOptions | None = None) -> NgramMethod:
        """`options`: --max-model-len and the target model, whose vocabulary bounds the ids."""
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        vocab_size, target_len = (0, 0) if options is None else target_limits(options.target_model)
        max_model_len = ((options.max_model_len if options is not None else None)
                         or target_len or DEFAULT_NGRAM_MAX_MODEL_LEN)
        return cls(
            proposer=NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                   config.num_speculative_tokens),
            info=ProposerInfo(method="ngram",
                              max_num_speculative_tokens=config.num_speculative_tokens,
                              vocab_size=vocab_size, max_model_len=max_model_len),
        )

    def context_len(self, seq_id: int) -> int | None:
        history = self._histories.get(seq_id)
        return None if history is None else len(history)

    def add_sequence(self, seq_id: int) -> None:
        self._histories[seq_id] = TokenHistory()

    def append_tokens(self, seq_id: int, token_ids: Sequence[int],
                      hidden_states: torch.Tensor | None) -> None:
        self._histories[seq_id].extend(token_ids)

    def rollback(self, seq_id: int, num_accepted_tokens: int) -> None:
        # Drafts never enter the history, so there is nothing to undo.
        pass

    def remove_sequence(self, seq_id: int) -> None:
        self._histories.pop(seq_id, None)

    def propose(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> list[Proposal]:
        proposals = []
        for seq_id, count in zip(seq_ids, num_tokens):
            draft, confidence = self.proposer.propose_with_confidence(
                self._histories[seq_id].view(), count)
            proposals.append(Proposal(draft, confidence=confidence or None))
        return proposals

    def close(self) -> None:
        self._histories.clear()


def target_limits(target_model: str) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from a target model directory's config.json.

    (0, 0) when `target_model` is not a local directory (a model name is never resolved
    here: ngram downloads nothing and imports no torch). The launcher passes the resolved
    directory, so its ngram drafter knows the verifier's vocabulary and reports it in
    GetInfo, where the verifier checks it.
    """
    path = Path(target_model).expanduser() / "config.json"
    if not path.is_file():
        return 0, 0
    try:
        config = json.loads(path.read_text())
        config = config.get("text_config", config)  # multimodal configs nest the LM's
        return int(config.get("vocab_size") or 0), int(config.get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        logger.warning("ngram: cannot read the target's limits from %s: %s", path, exc)
        return 0, 0
