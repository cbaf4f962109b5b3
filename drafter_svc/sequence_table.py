"""What one Propose stream may hold and the sequences it holds (`StreamLimits`,
`SequenceTable`): the stream bounds of drafter_svc/servicer.py's docstring."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from drafter_svc.proposer import DEFAULT_NGRAM_MAX_MODEL_LEN, Proposer, ProposerInfo
from specdec.config_flags import flag
from specdec.errors import ConfigError

# Above any verifier's --max-num-seqs default (256), so a stream from one never evicts.
DEFAULT_MAX_SEQS_PER_STREAM = 1024
# A running sequence is updated every verifier step; one quiet this long was leaked.
DEFAULT_SEQ_IDLE_TIMEOUT_S = 300.0
# A verifier's default --max-num-seqs (256) at a context of 8,192 tokens each.
DEFAULT_MAX_TOKENS_PER_STREAM = 256 * 8192
# One stream per verifier (and per replica name it dials): far above a real deployment's.
DEFAULT_MAX_PROPOSE_STREAMS = 64
# Ids accepted when the method knows no vocabulary (ngram without a target directory):
# what int32 holds, the token arrays' dtype.
UNKNOWN_VOCAB_ID_LIMIT = 1 << 31
# A stream that keeps overflowing logs its evictions at most this often.
_FULL_WARNING_INTERVAL_S = 60.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """What one Propose stream may hold (drafter flags); the model's own limits (vocabulary,
    max-model-len) come from ProposerInfo."""

    max_seqs_per_stream: int = field(default=DEFAULT_MAX_SEQS_PER_STREAM, metadata=flag(
        "sequences one verifier stream may hold; a new one evicts the least recently updated "
        "(at least the verifier's --max-num-seqs)"))
    seq_idle_timeout_s: float = field(default=DEFAULT_SEQ_IDLE_TIMEOUT_S, metadata=flag(
        "evict the state of a sequence not updated for this long"))
    max_tokens_per_stream: int = field(default=DEFAULT_MAX_TOKENS_PER_STREAM, metadata=flag(
        "tokens one verifier stream may hold over all its sequences; a sequence that would "
        "pass it is not drafted for"))
    max_propose_streams: int = field(default=DEFAULT_MAX_PROPOSE_STREAMS, metadata=flag(
        "Propose streams open at once; one more is refused with RESOURCE_EXHAUSTED"))

    def __post_init__(self) -> None:
        for name in ("max_seqs_per_stream", "max_tokens_per_stream", "max_propose_streams"):
            if getattr(self, name) < 1:
                option = "--" + name.replace("_", "-")
                raise ConfigError(f"{option} must be >= 1, got {getattr(self, name)}", param=name)
        if not self.seq_idle_timeout_s > 0:
            raise ConfigError(f"--seq-idle-timeout-s must be > 0, got {self.seq_idle_timeout_s}",
                              param="seq_idle_timeout_s")


def token_id_limit(info: ProposerInfo) -> int:
    return info.vocab_size or UNKNOWN_VOCAB_ID_LIMIT


def max_model_len(info: ProposerInfo) -> int:
    return info.max_model_len or DEFAULT_NGRAM_MAX_MODEL_LEN


class SequenceTable:
    """The sequences one stream holds, least recently updated first (see the module docstring).

    Every held sequence is in the table; `too_long` ones hold no state in the proposer.
    """

    def __init__(self, proposer: Proposer, limits: StreamLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proposer = proposer
        self.limits = limits
        self._clock = clock
        self._last_seen: OrderedDict[int, float] = OrderedDict()
        self.too_long: set[int] = set()
        # Refused for --max-tokens-per-stream: held without tokens, like too_long ones.
        self.over_budget: set[int] = set()
        self.num_evicted = 0
        self._last_full_warning = float("-inf")

    def __len__(self) -> int:
        return len(self._last_seen)

    def num_tokens(self) -> int:
        """Tokens held for this stream's sequences."""
        return sum(self.proposer.context_len(seq_id) or 0 for seq_id in self._last_seen)

    def touch(self, seq_id: int) -> None:
        """seq_id was just updated; a new one first evicts the least recently updated ones."""
        if seq_id in self._last_seen:
            self._last_seen.move_to_end(seq_id)
        else:
            evicted = False
            while len(self._last_seen) >= self.limits.max_seqs_per_stream:
                self._evict(next(iter(self._last_seen)))
                evicted = True
            now = self._clock()
            if evicted and now - self._last_full_warning >= _FULL_WARNING_INTERVAL_S:
                self._last_full_warning = now
                logger.warning("a Propose stream holds %d sequences, the most allowed: the "
                               "least recently updated are evicted (%d so far; "
                               "--max-seqs-per-stream must be at least the verifier's "
                               "--max-num-seqs)", self.limits.max_seqs_per_stream,
                               self.num_evicted)
        self._last_seen[seq_id] = self._clock()

    def mark_too_long(self, seq_id: int) -> None:
        self.proposer.remove_sequence(seq_id)
        self.touch(seq_id)
        self.too_long.add(seq_id)

    def mark_over_budget(self, seq_id: int) -> None:
        self.proposer.remove_sequence(seq_id)
        self.touch(seq_id)
        self.over_budget.add(seq_id)

    def remove(self, seq_id: int) -> None:
        self._last_seen.pop(seq_id, None)
        self.too_long.discard(seq_id)
        self.over_budget.discard(seq_id)
        self.proposer.remove_sequence(seq_id)

    def evict_idle(self) -> int:
        """Evicts the sequences not updated for seq_idle_timeout_s; returns how many."""
        oldest_kept = self._clock() - self.limits.seq_idle_timeout_s
        num_evicted = 0
        while self._last_seen:
            seq_id, seen = next(iter(self._last_seen.items()))
            if seen > oldest_kept:
                break
            self._evict(seq_id)
            num_evicted += 1
        if num_evicted:
            logger.info("evicted %d sequences not updated for %.0f s", num_evicted,
                        self.limits.seq_idle_timeout_s)
        return num_evicted

    def _evict(self, seq_id: int) -> None:
        self.remove(seq_id)
        self.num_evicted += 1
