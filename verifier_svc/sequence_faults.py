"""One sequence's failure is that sequence's alone.

Everything the engine does for one sequence in a step (its grammar's forced tokens, draft
cut, masks and advance; its sampling, stop handling and logprobs) runs inside
`SequenceFaults.isolate`: an exception there fails that sequence with a short error and the
step goes on for the others. Only what the step shares (the scheduler's plan, the drafters'
round trip, the forward) fails the step (`Engine._fail_step`).

A grammar that exceeds the grammar library's limits mid-generation is the request's own
fault: its `GrammarLimitError` (INVALID_ARGUMENT, naming `grammar`) reaches the client as
is, logged as a warning. Any other exception is a bug: the client gets an `EngineError`
naming only the exception's type, the log its traceback. Log lines name the request and
the error, truncated, never a whole grammar.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from specdec.engine.sequence import Sequence
from specdec.errors import SpecdecError
from verifier_svc.grammar.matcher import GrammarLimitError
from verifier_svc.requests import EngineError

logger = logging.getLogger(__name__)

MAX_LOGGED_CHARS = 300


class SequenceFaults:
    """Fails one sequence at a time through `fail(seq, error)` (the engine's `_fail`)."""

    def __init__(self, fail: Callable[[Sequence, SpecdecError], None]) -> None:
        self._fail = fail
        # Failures met where the sequence cannot be failed at once (inside the scheduler's
        # plan): failed by `flush`.
        self._deferred: list[tuple[Sequence, SpecdecError]] = []
        self.num_failed = 0

    @contextlib.contextmanager
    def isolate(self, seq: Sequence, *, defer: bool = False) -> Iterator[None]:
        """Runs the block for `seq` alone: an exception fails `seq` (now, or at the next
        `flush` when `defer`) and is not raised further."""
        try:
            yield
        except Exception as exc:
            self.fail(seq, exc, defer=defer)

    def fail(self, seq: Sequence, exc: Exception, *, defer: bool = False) -> None:
        """Fails `seq` for `exc` (now, or at the next `flush` when `defer`)."""
        error = self._error_for(seq, exc)
        if defer:
            self._deferred.append((seq, error))
        else:
            self._fail_alone(seq, error)

    def flush(self) -> None:
        """Fails the sequences whose failure was deferred."""
        deferred, self._deferred = self._deferred, []
        for seq, error in deferred:
            self._fail_alone(seq, error)

    def _fail_alone(self, seq: Sequence, error: SpecdecError) -> None:
        self.num_failed += 1
        try:
            self._fail(seq, error)
        except Exception:
            logger.exception("failing request %s raised", seq.request_id)

    @staticmethod
    def _error_for(seq: Sequence, exc: Exception) -> SpecdecError:
        if isinstance(exc, GrammarLimitError):
            logger.warning("request %s failed alone: %s", seq.request_id,
                           _truncated(exc.message))
            return exc
        logger.error("request %s failed alone: %s: %s", seq.request_id, type(exc).__name__,
                     _truncated(str(exc)), exc_info=True)
        return EngineError(f"the engine failed on this request ({type(exc).__name__}); it was "
                           "aborted, other requests go on")


def _truncated(text: str) -> str:
    return text if len(text) <= MAX_LOGGED_CHARS else f"{text[:MAX_LOGGED_CHARS]}..."
