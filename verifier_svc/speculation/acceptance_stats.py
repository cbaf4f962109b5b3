"""What the speculation policy measures per sequence and engine-wide: decayed counts of
how drafts were accepted, position by position, and of how often an ask to the drafter
brought any draft at all (used by verifier_svc/speculation/policy.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class AcceptanceStats:
    """Per-position conditional acceptance counts (decayed).

    `reached[i]`: drafts that had a token at position i with every earlier token accepted;
    `accepted[i]`: how many of those accepted it.
    """

    decay: float
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    version: int = 0  # drafts recorded: estimates made from these counts are current while it stays

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.version += 1
        self.reached = [count * self.decay for count in self.reached]
        self.accepted = [count * self.decay for count in self.accepted]
        if len(self.reached) < num_draft_tokens:
            grow = num_draft_tokens - len(self.reached)
            self.reached.extend([0.0] * grow)
            self.accepted.extend([0.0] * grow)
        for position in range(min(num_accepted + 1, num_draft_tokens)):
            self.reached[position] += 1.0
        for position in range(num_accepted):
            self.accepted[position] += 1.0

    def has_reached(self, position: int) -> bool:
        """Whether recent drafts (about one, decayed) had a token at `position` to verify."""
        return position < len(self.reached) and self.reached[position] >= 0.5

    def rate(self, position: int, prior: float, prior_weight: float) -> float:
        """Estimated chance that the draft at `position` is accepted given the earlier ones were."""
        reached = self.reached[position] if position < len(self.reached) else 0.0
        accepted = self.accepted[position] if position < len(self.accepted) else 0.0
        return (accepted + prior_weight * prior) / (reached + prior_weight)


@dataclass(slots=True)
class ProposalStats:
    """How often the drafter, when asked, proposed anything (decayed counts): ngram finds
    no match on new text, and an empty answer costs a round trip but no verification."""

    decay: float
    asked: float = 0.0
    proposed: float = 0.0

    def record(self, proposed: bool) -> None:
        self.asked = self.asked * self.decay + 1.0
        self.proposed = self.proposed * self.decay + (1.0 if proposed else 0.0)

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.proposed + prior_weight * prior) / (self.asked + prior_weight)
