"""The verifier's start-up phases, which its gRPC `GetInfo` reports while it starts
(verifier_svc.starting_servicer) and a gateway shows in /health."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

PHASE_STARTING = "starting"
PHASE_COMPILING_KERNELS = "compiling kernels"
PHASE_LOADING_WEIGHTS = "loading weights"
PHASE_WARMING_UP = "warming up"
PHASE_WAITING_FOR_DRAFTER = "waiting for a drafter"


class StartupPhase:
    """What the verifier is doing while it starts. Set from the thread building the engine,
    read on the event loop: one attribute assignment, never half-written."""

    def __init__(self) -> None:
        self.name = PHASE_STARTING

    def enter(self, name: str) -> None:
        logger.info("start-up: %s", name)
        self.name = name
