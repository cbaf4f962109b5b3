"""Which drafter replica drafts each sequence, and how much of its context that replica
holds (verifier_svc.drafting.drafter_pool).

Invariants: a sequence sticks to the replica it was assigned to (the least loaded healthy
one) until that replica goes down; then it is reassigned on its next step with a full
resync. `SeqState.num_synced_tokens` tokens of the sequence's verified context (and
`num_synced_hidden_rows` rows of its target hidden states) are on its replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verifier_svc.drafting.drafter_replica import DrafterReplica


@dataclass(slots=True)
class SeqState:
    replica: DrafterReplica
    num_synced_tokens: int
    num_synced_hidden_rows: int = 0


class SequencePlacement:
    """seq_id -> its replica and what that replica holds of it; each replica's `seq_ids`
    mirror it."""

    def __init__(self) -> None:
        self._seqs: dict[int, SeqState] = {}

    def get(self, seq_id: int) -> SeqState | None:
        return self._seqs.get(seq_id)

    def finish(self, seq_id: int) -> SeqState | None:
        """Forgets a finished sequence; its state, for telling its replica."""
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            state.replica.seq_ids.discard(seq_id)
        return state

    def assign(self, seq_id: int, replicas: Sequence[DrafterReplica]) -> SeqState | None:
        """Puts seq_id on the least loaded healthy replica, to be synced from scratch."""
        # A replica still catching up would answer late: its drafts would miss the deadline.
        healthy = [replica for replica in replicas if replica.healthy and not replica.catching_up]
        if not healthy:
            return None
        old = self._seqs.get(seq_id)
        if old is not None:
            old.replica.seq_ids.discard(seq_id)
        replica = min(healthy, key=lambda candidate: len(candidate.seq_ids))
        replica.seq_ids.add(seq_id)
        state = self._seqs[seq_id] = SeqState(replica, 0)
        return state

    def needs_resync(self, replica: DrafterReplica, seq_id: int) -> None:
        """The replica lost the sequence's state: its next message carries it all."""
        state = self._seqs.get(seq_id)
        if state is not None and state.replica is replica:
            state.num_synced_tokens = 0
            state.num_synced_hidden_rows = 0

    def drop_replica(self, replica: DrafterReplica) -> None:
        """The replica lost its stream: its sequences get reassigned on their next step."""
        for seq_id in replica.seq_ids:
            state = self._seqs.get(seq_id)
            if state is not None and state.replica is replica:
                del self._seqs[seq_id]
        replica.seq_ids.clear()

    def clear(self) -> None:
        self._seqs.clear()
