"""The one error hierarchy of specdec.

Domain code raises these; `grpc_status` maps them once to gRPC status codes and the
gateway maps them once to OpenAI error JSON. Never send a traceback to a client.
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class. `param` names the offending field where there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(SpecdecError):
    """Invalid start-up configuration (flags, --speculative-config, model path)."""


class InvalidRequestError(SpecdecError):
    """A request carries a value out of range or of the wrong kind."""


class ModelNotFoundError(SpecdecError):
    """The requested model name is not served here."""


class UnavailableError(SpecdecError):
    """A backend (verifier, drafter) cannot be reached now; retrying may work."""


class OverloadedError(SpecdecError):
    """The request queue is full."""


class DrafterMismatchError(SpecdecError):
    """A drafter built for another model (vocabulary or tokenizer) was refused."""
