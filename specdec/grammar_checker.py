"""Grammar checks in processes of their own, under a time budget, cancelled with their request.

A constraint's translation and validation by llguidance can take minutes (a JSON Schema's
`patternProperties`: ~n^3 in the pattern count, 25 s at 300 patterns) and cannot be
interrupted from Python, and llguidance's fuel limits do not bound it. So the gateway and
the verifier check each new constraint in a worker process (`specdec.grammar_worker`),
never in a thread pool that other work (chat templating) needs: a check past its budget
is a 400 naming the field, and a check whose request ended (client gone, deadline) is
cancelled; either way its worker is killed and another started for the next check. At
most `num_workers` checks run at once; the others wait for a worker.

The verifier's workers hold the model's tokenizer and do all of its admission work (the
matcher's compile and its probe): only a grammar that passed is compiled again in-process,
where nothing can stop it, and that costs no more than the check the budget allowed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

from specdec.config_flags import flag
from specdec.errors import ConfigError, InvalidRequestError, SpecdecError
from specdec.grammar_spec import MAX_GRAMMAR_CHARS
from specdec.grammar_tokenizer import GrammarTokenizer

logger = logging.getLogger(__name__)

DEFAULT_CHECK_WORKERS = 2
DEFAULT_CHECK_TIMEOUT_S = 10.0
# A grammar's text travels on one line (the llguidance text of a 1 MiB schema is larger).
MAX_LINE_BYTES = 256 << 20
# Constraints up to this size that passed are remembered (an agent sends the same schema
# with every request), at most this many: ~4 MiB of keys.
MAX_REMEMBERED_CHARS = 16 * 1024
MAX_REMEMBERED = 256


@dataclass(frozen=True)
class GrammarLimits:
    """What one constraint may cost (the --grammar-* flags of the gateway and verifier)."""

    compile_timeout_s: float = field(default=DEFAULT_CHECK_TIMEOUT_S, metadata=flag(
        "a structured-output constraint that takes longer to compile is refused with a 400",
        name="--grammar-compile-timeout-s"))
    compile_workers: int = field(default=DEFAULT_CHECK_WORKERS, metadata=flag(
        "processes that compile constraints; more wait for one",
        name="--grammar-compile-workers"))
    max_chars: int = field(default=MAX_GRAMMAR_CHARS, metadata=flag(
        "a longer constraint (schema, regex, grammar, choice list) is refused with a 400",
        name="--max-grammar-chars"))

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ConfigError("--grammar-compile-timeout-s must be > 0",
                              param="grammar_compile_timeout_s")
        if self.compile_workers < 1:
            raise ConfigError("--grammar-compile-workers must be >= 1",
                              param="grammar_compile_workers")
        if self.max_chars < 1:
            raise ConfigError("--max-grammar-chars must be >= 1", param="max_grammar_chars")


class GrammarChecker:
    """`check(kind, value, param)`: llguidance's grammar text, or InvalidRequestError."""

    def __init__(self, limits: GrammarLimits, tokenizer: GrammarTokenizer | None = None) -> None:
        """`tokenizer`: the model's, for a check that is the verifier's whole admission
        (the matcher's compile and probe); without it, llguidance's validation alone."""
        self._setup_line = json.dumps(
            {"tokenizer": tokenizer.to_json() if tokenizer is not None else None}).encode()
        self.timeout_s = limits.compile_timeout_s
        self.max_chars = limits.max_chars
        # Idle workers; None stands for one to start when taken.
        self._idle: asyncio.Queue[asyncio.subprocess.Process | None] = asyncio.Queue()
        for _ in range(limits.compile_workers):
            self._idle.put_nowait(None)
        self._workers: set[asyncio.subprocess.Process] = set()
        # Killed workers being reaped in the background (close waits for them).
        self._reaping: set[asyncio.Task[int]] = set()
        self._passed: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.num_killed = 0

    async def check(self, kind: str, value: str, *, param: str) -> str:
        key = (kind, value)
        text = self._passed.get(key)
        if text is not None:
            self._passed.move_to_end(key)
            return text
        text = await self._check_in_worker(kind, value, param)
        if len(value) <= MAX_REMEMBERED_CHARS and len(text) <= MAX_REMEMBERED_CHARS:
            self._passed[key] = text
            while len(self._passed) > MAX_REMEMBERED:
                self._passed.popitem(last=False)
        return text

    async def _check_in_worker(self, kind: str, value: str, param: str) -> str:
        worker = await self._idle.get()
        keep: asyncio.subprocess.Process | None = None
        try:
            if worker is None or worker.returncode is not None:
                worker = await self._start()
            reply = await asyncio.wait_for(self._ask(worker, kind, value, param), self.timeout_s)
            keep = worker
        except TimeoutError:
            logger.warning("a %s for %s took longer than %.1f s to compile: refused",
                           kind, param, self.timeout_s)
            raise InvalidRequestError(
                f"the {kind.replace('_', ' ')} took longer than {self.timeout_s:g} s to compile",
                param=param) from None
        finally:
            if keep is None and worker is not None:
                self._kill(worker)  # cancelled, timed out or broken: its check is abandoned
            self._idle.put_nowait(keep)
        if "text" in reply:
            return reply["text"]
        if "invalid" in reply:
            raise InvalidRequestError(reply["invalid"], param=param)
        raise SpecdecError(f"the grammar check failed: {reply.get('error', 'no reply')}")

    async def _ask(self, worker: asyncio.subprocess.Process, kind: str, value: str,
                   param: str) -> dict:
        line = json.dumps({"kind": kind, "value": value, "param": param,
                           "max_chars": self.max_chars})
        return await self._exchange(worker, line.encode())

    @staticmethod
    async def _exchange(worker: asyncio.subprocess.Process, line: bytes) -> dict:
        """Sends `line` to `worker`, returns its one-line reply."""
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write(line + b"\n")
        await worker.stdin.drain()
        reply = await worker.stdout.readline()
        if not reply:
            raise SpecdecError("the grammar check worker exited")
        return json.loads(reply)

    async def _start(self) -> asyncio.subprocess.Process:
        """A new worker, its tokenizer built (outside any check's budget)."""
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specdec.grammar_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=MAX_LINE_BYTES)
        self._workers.add(worker)
        try:
            reply = await self._exchange(worker, self._setup_line)
            if not reply.get("ready"):
                raise SpecdecError(f"the grammar check worker did not start: {reply}")
        except BaseException:
            self._kill(worker)  # cancelled or broken while starting
            raise
        return worker

    def _kill(self, worker: asyncio.subprocess.Process, *, reap: bool = True) -> None:
        self._workers.discard(worker)
        if worker.returncode is None:
            worker.kill()
            self.num_killed += 1
            if reap:  # in the background: the caller is not kept waiting for it
                reaping = asyncio.get_running_loop().create_task(worker.wait())
                self._reaping.add(reaping)
                reaping.add_done_callback(self._reaping.discard)

    async def close(self) -> None:
        """Kills every worker (those checking too) and reaps it, and those killed before."""
        workers = list(self._workers)
        for worker in workers:
            self._kill(worker, reap=False)
        for worker in workers:
            await worker.wait()
        await asyncio.gather(*self._reaping)
