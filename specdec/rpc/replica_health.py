"""A replica's health as its client judges it, on evidence only, and the check that a
replica serves the client's own model.

A replica is marked down on evidence: a refused or lost connection, a failed call, a
health answer NOT_SERVING, a stream that broke. A call that only ran out of time is not:
a verifier answers probes on the loop that runs its forwards and a drafter answers on its
own, so under load their answers queue behind busy work. Only a replica that has answered
nothing at all for a long silence is taken for hung. Used by the gateway for its verifiers
(gateway.verifier_client, which probes) and by the verifier for its drafters
(verifier_svc.drafting.drafter_replica, whose stream is the evidence).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

SERVING = "serving"
# Draining or shutting down: it answered, and said so.
NOT_SERVING = "not_serving"
# Down, or never reached yet.
UNREACHABLE = "unreachable"


@dataclass(slots=True, eq=False)
class ReplicaHealth:
    """Whether a replica takes work now (`healthy`), in a word (`status`), and when it last
    showed it works (a call answered, a response read), on the monotonic clock."""

    healthy: bool = False
    status: str = UNREACHABLE
    last_alive_s: float = 0.0
    # Held while a probe of this replica is in flight: one at a time, however many ask.
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The last refusal reason logged: a mismatch is logged once, not on every check.
    refusal_logged: str | None = None

    def alive(self) -> None:
        """The replica answered something just now."""
        self.last_alive_s = time.monotonic()

    def up(self, status: str = SERVING) -> bool:
        """Marks it serving (and alive); returns whether it was down before."""
        was_down = not self.healthy
        self.healthy = True
        self.status = status
        self.alive()
        return was_down

    def down(self, status: str = UNREACHABLE) -> bool:
        """Marks it down on evidence; returns whether it was up before."""
        was_up = self.healthy
        self.healthy = False
        self.status = status
        return was_up

    def silent_s(self) -> float:
        return time.monotonic() - self.last_alive_s

    def timeout_is_evidence(self, silent_down_s: float) -> bool:
        """Whether a call that ran out of time takes the replica down: only when it was
        not up anyway, or has answered nothing for `silent_down_s`."""
        return not self.healthy or self.silent_s() >= silent_down_s

    async def probe(self, probe_now: Callable[[], Awaitable[bool]]) -> bool:
        """Runs `probe_now` (which judges and returns whether the replica is up), or, with
        a probe of it already in flight, waits for that one and shares its answer."""
        if self.probe_lock.locked():
            async with self.probe_lock:
                return self.healthy
        async with self.probe_lock:
            return await probe_now()

    def refusal_is_new(self, reason: str) -> bool:
        """Whether `reason` (why the replica is refused) differs from the one last logged;
        remembers it."""
        is_new = reason != self.refusal_logged
        self.refusal_logged = reason
        return is_new


class ModelInfo(Protocol):
    """What a replica's GetInfo says of its model (VerifierInfo and DrafterInfo both)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer_fingerprint(self) -> str: ...


def model_mismatch(info: ModelInfo, *, vocab_size: int | None, tokenizer_fingerprint: str | None,
                   ours: str) -> list[str]:
    """How the replica's model differs from the client's (`ours` names the client, e.g.
    "verifier"), one phrase per difference, [] when none. A side that reports no value (0,
    "", None) is not compared: a method without a vocabulary of its own has nothing to
    disagree with."""
    problems = []
    if vocab_size and info.vocab_size and info.vocab_size != vocab_size:
        problems.append(f"its vocab_size is {info.vocab_size}, the {ours}'s is {vocab_size}")
    if (tokenizer_fingerprint and info.tokenizer_fingerprint
            and info.tokenizer_fingerprint != tokenizer_fingerprint):
        problems.append(f"its tokenizer fingerprint is {info.tokenizer_fingerprint!r}, the "
                        f"{ours}'s is {tokenizer_fingerprint!r}")
    return problems
