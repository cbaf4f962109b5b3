"""The verifier's grammar backend: llguidance, built once per model.

`GrammarBackend(tokenizer, vocab_size)` wraps the model's tokenizer for llguidance once (about
half a second for a 49k vocabulary), compiles (kind, value) constraints into
`CompiledGrammar`s kept in a thread-safe LRU cache keyed by (kind, value), and starts one
`GrammarState` per sequence from a compiled grammar. `compile_async` first checks a new
constraint in a `GrammarChecker` process (under the time budget, cancelled when its request
ends: a check can take minutes and cannot be interrupted in-process), then builds the
matcher in the backend's own worker threads (llguidance drops the GIL while it builds), so
the engine loop never waits on a large schema. A compiled grammar is probed before
admission: its first mask, and its first allowed token, must stay within llguidance's
limits (a 20,000-string choice or `(a{1000}){1000}` fail there, not mid-step). Why
llguidance and not xgrammar: docs/performance.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.grammar_checker import GrammarChecker, GrammarLimits
from specdec.grammar_spec import check_grammar, parser_limits
from verifier_svc.grammar.matcher import GrammarLimitError, GrammarState, allocate_bitmask

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 512
# llguidance's error for a grammar with no way to go on (from its start: one that matches
# nothing, e.g. a schema whose $ref cycle has no base case).
_NO_OUTPUT_ERROR = "NoExtensionBias"
DEFAULT_COMPILE_THREADS = 2


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for one model's tokenizer; shared by every sequence using it."""

    kind: str
    value: str
    grammar: str  # llguidance's grammar text
    compile_s: float
    # The matcher in its start state; every sequence starts from a deep copy of it.
    template: Any = field(repr=False, compare=False)


class _CompileFailure(Exception):
    """A cached compile error: the reason, re-raised with each caller's own `param`."""


class GrammarBackend:
    """llguidance for one model: tokenizer info built once, compiled grammars cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, *,
                 eos_token_ids: Sequence[int] | None = None,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 compile_threads: int = DEFAULT_COMPILE_THREADS,
                 limits: GrammarLimits | None = None) -> None:
        """`tokenizer`: the model's transformers fast tokenizer; `vocab_size`: the model's
        logits width (may exceed the tokenizer's size: the padding ids are never allowed);
        `eos_token_ids`: the ids that end a sequence (default: the tokenizer's EOS)."""
        import llguidance.hf

        tokenizer_size = len(tokenizer)
        if vocab_size < tokenizer_size:
            raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_size}")
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = tokenizer_size
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        started = time.perf_counter()
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(self.eos_token_ids) or None)
        logger.info("grammar backend: llguidance tokenizer info for %d tokens in %.2f s",
                    tokenizer_size, time.perf_counter() - started)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=compile_threads,
                                           thread_name_prefix="grammar-compile")
        self.limits = limits or GrammarLimits()
        # Made on the first compile_async, on the engine's event loop.
        self._checker: GrammarChecker | None = None
        self.hits = 0
        self.misses = 0

    # -- compilation ---------------------------------------------------------------------
    def compile(self, kind: str, value: str, *, param: str = "grammar",
                text: str | None = None) -> CompiledGrammar:
        """The compiled grammar for (kind, value), from the cache when it was compiled before.

        Raises InvalidRequestError (gRPC INVALID_ARGUMENT, HTTP 400) saying why, naming
        `param`. Threads asking for the same grammar at once compile it once. `text`: the
        llguidance grammar, checked already (by the GrammarChecker).
        """
        key = (kind, value)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                owner = False
            else:
                future = Future()
                self._cache[key] = future
                self.misses += 1
                owner = True
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if owner:
            try:
                future.set_result(self._compile_uncached(kind, value, text))
            except InvalidRequestError as error:
                # Cached too: a client retrying a bad schema costs nothing.
                future.set_exception(_CompileFailure(error.message))
            except BaseException as error:
                # Unexpected: not cached, so a later call tries again.
                with self._lock:
                    if self._cache.get(key) is future:
                        del self._cache[key]
                future.set_exception(error)
        try:
            return future.result()
        except _CompileFailure as failure:
            raise InvalidRequestError(str(failure), param=param) from None

    async def compile_async(self, kind: str, value: str, *, param: str = "grammar") -> CompiledGrammar:
        """`compile` in the backend's worker threads; the event loop keeps running."""
        key = (kind, value)
        with self._lock:
            future = self._cache.get(key)
            ready = future is not None and future.done()
        if ready:
            return self.compile(kind, value, param=param)  # a cache hit costs no thread hop
        if self._checker is None:
            self._checker = GrammarChecker(self.limits)
        text = await self._checker.check(kind, value, param=param)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: self.compile(kind, value, param=param, text=text))

    def _compile_uncached(self, kind: str, value: str, text: str | None) -> CompiledGrammar:
        import llguidance

        started = time.perf_counter()
        if text is None:
            text = check_grammar(kind, value, param="grammar", tokenizer=self.ll_tokenizer,
                                 max_chars=self.limits.max_chars)
        template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0,
                                        limits=parser_limits())
        if template.is_error():
            raise InvalidRequestError(f"invalid {kind.replace('_', ' ')}: "
                                      f"{GrammarLimitError(template.get_error()).detail}")
        self._probe(kind, template)
        elapsed = time.perf_counter() - started
        logger.debug("compiled %s grammar (%d chars) in %.1f ms", kind, len(value), elapsed * 1e3)
        return CompiledGrammar(kind=kind, value=value, grammar=text, compile_s=elapsed,
                               template=template)

    def _probe(self, kind: str, template: Any) -> None:
        """Raises InvalidRequestError when the grammar's first mask, or its first allowed
        token, takes llguidance past its limits (the error state it would reach mid-step)."""
        state = GrammarState(template.deep_copy(), tokenizer_vocab_size=self.tokenizer_vocab_size,
                             vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids)
        mask = allocate_bitmask(1, self.vocab_size)
        try:
            state.fill_next_mask(mask)
            first = _first_allowed(mask[0], self.eos_token_ids)
            if first is not None:
                state.accept(first)
                state.fill_next_mask(mask)
        except GrammarLimitError as error:
            if error.detail.startswith(_NO_OUTPUT_ERROR):
                raise InvalidRequestError(
                    f"the {kind.replace('_', ' ')} matches no text at all (a $ref that only "
                    "refers to itself?)") from None
            raise InvalidRequestError(f"the {kind.replace('_', ' ')} exceeds the grammar "
                                      f"library's limits: {error.detail}") from None

    # -- sequences -----------------------------------------------------------------------
    def new_state(self, compiled: CompiledGrammar) -> GrammarState:
        """A fresh per-sequence state at the grammar's start."""
        return GrammarState(compiled.template.deep_copy(),
                            tokenizer_vocab_size=self.tokenizer_vocab_size,
                            vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids)

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._cache)}

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._checker is not None:
            await self._checker.close()


def _first_allowed(row: Any, eos_token_ids: tuple[int, ...]) -> int | None:
    """The lowest token id a bitmask row allows, EOS aside; None when it allows none."""
    import numpy as np

    words = row.numpy().view(np.uint32)
    for index in np.flatnonzero(words):
        word = int(words[index])
        while word:
            bit = (word & -word).bit_length() - 1
            token_id = int(index) * 32 + bit
            if token_id not in eos_token_ids:
                return token_id
            word &= word - 1
    return None
