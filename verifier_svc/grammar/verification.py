"""Verification under a grammar: what the engine does for sequences with a constraint.

Per step, for each sequence with a grammar (`GrammarState`, advanced only by verified
tokens):
1. plan: the tokens the grammar forces next (its only continuation) become the draft, with
   no drafter round trip; they are always accepted, since the masked target puts all its
   mass on them (`GrammarState.forced_tokens`);
2. a drafter's proposal is cut at its first token the grammar rejects, before the forward,
   so that position costs nothing (`GrammarState.valid_prefix_len`);
3. after the forward, one mask per verified position (row i: what the grammar allows after
   the drafts before i) sets the target's logits to -inf outside the grammar, before
   acceptance, for greedy and sampled verification alike (`mask_rows`);
4. the emitted tokens advance the state (`advance`). The masks were computed without
   moving it, so the state is at the accepted prefix: rolled back, in effect.

The backend (llguidance's tokenizer info, ~0.5 s) is built in a thread when the engine
starts, and compilation runs in worker threads: the engine loop never blocks on either.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import torch

from specdec.errors import InvalidRequestError
from verifier_svc.grammar.backend import CompiledGrammar, GrammarBackend
from verifier_svc.grammar.matcher import GrammarState, allocate_bitmask, apply_masks

logger = logging.getLogger(__name__)


class GrammarService:
    """The verifier's grammar backend, made on first use."""

    def __init__(self, make_backend: Callable[[], GrammarBackend]) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._failure: str | None = None
        self._lock = threading.Lock()
        # Seconds the engine spent on grammars (masks, cuts, forced tokens, advancing).
        self.seconds = 0.0

    def start_warm_up(self) -> None:
        """Builds the backend in a daemon thread now, so that a server's first constrained
        request does not wait for it (it waits on the lock if it comes sooner)."""
        threading.Thread(target=self._warm_up, name="grammar-warm-up", daemon=True).start()

    def _warm_up(self) -> None:
        try:
            self._get_backend()
        except InvalidRequestError:
            pass  # remembered; each constrained request is told

    def _get_backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None and self._failure is None:
                try:
                    self._backend = self._make_backend()
                except Exception as exc:
                    logger.warning("no grammar backend for this model: %s: %s",
                                   type(exc).__name__, exc)
                    self._failure = f"{type(exc).__name__}: {exc}"
            if self._backend is None:
                raise InvalidRequestError(
                    "structured outputs are not available with this model's tokenizer "
                    f"({self._failure})", param="grammar")
            return self._backend

    async def compile(self, kind: str, value: str, *, param: str = "grammar") -> CompiledGrammar:
        """Raises InvalidRequestError naming `param` when the grammar does not compile."""
        backend = self._backend
        if backend is None:
            backend = await asyncio.get_running_loop().run_in_executor(None, self._get_backend)
        return await backend.compile_async(kind, value, param=param)

    def new_state(self, compiled: CompiledGrammar) -> GrammarState:
        return self._get_backend().new_state(compiled)

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.close()


def mask_rows(logits: torch.Tensor, jobs: list[tuple[int, GrammarState, list[int]]],
              vocab_size: int) -> list[tuple[int, Exception]]:
    """Masks, in place, each job's rows of the step's logits: (first row, state, draft)
    covers rows first .. first + len(draft). One bitmask is filled for all of them; each run
    of adjacent rows is masked through a view of its slice, so constrained rows with plain
    rows between them (any order in the batch) never need a gather and a scatter.

    Returns (job index, exception) for each job whose grammar raised filling its masks (a
    limit hit): its rows are left unmasked, for the engine to fail that sequence alone.

    The step's logits come out of the forward as inference tensors; an in-place update of
    one is allowed only inside inference mode, so the masking runs there.
    """
    num_rows = sum(len(draft) + 1 for _, _, draft in jobs)
    bitmask = allocate_bitmask(num_rows, vocab_size)
    runs: list[tuple[int, int, int]] = []  # (first logit row, first bitmask row, row count)
    failures: list[tuple[int, Exception]] = []
    offset = 0
    for job_index, (first_row, state, draft) in enumerate(jobs):
        count = len(draft) + 1
        try:
            state.fill_masks(draft, bitmask[offset:offset + count])
        except Exception as exc:
            failures.append((job_index, exc))
            offset += count
            continue
        if runs and runs[-1][0] + runs[-1][2] == first_row and runs[-1][1] + runs[-1][2] == offset:
            start, mask_start, length = runs[-1]
            runs[-1] = (start, mask_start, length + count)
        else:
            runs.append((first_row, offset, count))
        offset += count
    with torch.inference_mode():
        for first_row, mask_start, count in runs:
            apply_masks(logits[first_row:first_row + count], bitmask[mask_start:mask_start + count])
    return failures


def advance(state: GrammarState, token_ids: list[int], request_id: str,
            end_ids: frozenset[int] | set[int] = frozenset()) -> None:
    """Accepts the emitted tokens up to the first that ends the sequence (`end_ids`): a
    draft may hold EOS, after which the step's further tokens are dropped anyway."""
    end = next((i for i, token_id in enumerate(token_ids) if token_id in end_ids), None)
    if end is not None:
        token_ids = token_ids[:end + 1]
    accepted = state.accept_tokens(token_ids)
    if accepted != len(token_ids):  # masked logits cannot emit a rejected token
        logger.error("request %s: the grammar rejected emitted token %d (position %d of %d)",
                     request_id, token_ids[accepted], accepted, len(token_ids))


class Timer:
    """Adds the time of a `with` block to a GrammarService's `seconds`."""

    def __init__(self, service: GrammarService) -> None:
        self._service = service
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._service.seconds += time.perf_counter() - self._started
