"""The verifier's grammar backend: llguidance, built once per model.

`GrammarBackend(tokenizer, vocab_size)` wraps the model's tokenizer for llguidance once (about
half a second for a 49k vocabulary), compiles (kind, value) constraints into
`CompiledGrammar`s kept in a thread-safe LRU cache keyed by (kind, value), and starts one
`GrammarState` per sequence from a compiled grammar.

`compile_async` first compiles and probes a new constraint in a `GrammarChecker` process
holding the model's tokenizer: under the time budget, and killed when its request ends (a
compile can take minutes and cannot be interrupted in-process). Only a constraint that
passed is compiled again in the backend's own threads (llguidance drops the GIL while it
builds; the engine loop never waits on a large schema), at no more than the cost the check
took, and is not probed again. A compiled grammar's probe (`specdec.grammar_probe`) walks
its first tokens, so that one going past llguidance's limits there (a 20,000-string choice,
`(a{1000}){1000}`) is refused before admission, not mid-step. Why llguidance and not
xgrammar: docs/performance.md.
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
from specdec.grammar_probe import probe_matcher
from specdec.grammar_spec import compiled_matcher, grammar_text
from specdec.grammar_tokenizer import GrammarTokenizer
from verifier_svc.grammar.matcher import GrammarState

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 512
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
        tokenizer_size = len(tokenizer)
        if vocab_size < tokenizer_size:
            raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_size}")
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = tokenizer_size
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        started = time.perf_counter()
        self.tokenizer = GrammarTokenizer.from_hf(tokenizer, vocab_size, self.eos_token_ids)
        self.ll_tokenizer = self.tokenizer.build()
        logger.info("grammar backend: llguidance tokenizer info for %d tokens in %.2f s",
                    tokenizer_size, time.perf_counter() - started)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=compile_threads,
                                           thread_name_prefix="grammar-compile")
        self.limits = limits or GrammarLimits()
        # Made on first use (`checker`), on the engine's event loop.
        self._checker: GrammarChecker | None = None
        self.hits = 0
        self.misses = 0

    # -- compilation ---------------------------------------------------------------------
    def compile(self, kind: str, value: str, *, param: str = "grammar",
                text: str | None = None) -> CompiledGrammar:
        """The compiled grammar for (kind, value), from the cache when it was compiled before.

        Raises InvalidRequestError (gRPC INVALID_ARGUMENT, HTTP 400) saying why, naming
        `param`. Threads asking for the same grammar at once compile it once. `text`: the
        llguidance grammar, compiled and probed already with this tokenizer (by the
        GrammarChecker), so not probed again.
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
        text = await self.checker.check(kind, value, param=param)
        # Cancelled while it waits for a thread, it never starts; once started it runs to
        # its end (at most the check's cost) and is cached for the next request.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: self.compile(kind, value, param=param, text=text))

    @property
    def checker(self) -> GrammarChecker:
        """What checks a new constraint, in worker processes (made on first use: its queue
        belongs to the event loop that uses it)."""
        if self._checker is None:
            self._checker = GrammarChecker(self.limits, self.tokenizer)
        return self._checker

    def _compile_uncached(self, kind: str, value: str, text: str | None) -> CompiledGrammar:
        started = time.perf_counter()
        probed = text is not None
        if text is None:
            text = grammar_text(kind, value, max_chars=self.limits.max_chars)
        template = compiled_matcher(kind, text, self.ll_tokenizer)
        if not probed:
            probe_matcher(template.deep_copy(), kind,
                          tokenizer_vocab_size=self.tokenizer_vocab_size,
                          eos_token_ids=self.eos_token_ids)
        elapsed = time.perf_counter() - started
        logger.debug("compiled %s grammar (%d chars) in %.1f ms", kind, len(value), elapsed * 1e3)
        return CompiledGrammar(kind=kind, value=value, grammar=text, compile_s=elapsed,
                               template=template)

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
