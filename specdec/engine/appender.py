"""The append phase of a step: each sequence's verified tokens appended, up to its first
stop condition (a stop token, EOS, `max_tokens`, the context's end), and streamed to its
request with their logprobs when it asked; the KV slots of rejected drafts go back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from specdec.config import EngineConfig
from specdec.engine.logprobs import LogprobsJob, TokenLogprobs, step_logprobs
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import FinishReason, Sequence
from specdec.engine.verification import Verified
from specdec.errors import SpecdecError
from verifier_svc.requests import RequestOutput
from verifier_svc.sequence_faults import SequenceFaults


class Appender:
    """Appends verified tokens and streams them to the queues in `queues` (the engine's,
    by sequence id); `on_finish(seq, reason)` ends a sequence that met a stop condition."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, eos_token_ids: frozenset[int],
                 faults: SequenceFaults,
                 queues: dict[int, asyncio.Queue[RequestOutput | SpecdecError]],
                 on_finish: Callable[[Sequence, FinishReason], None]) -> None:
        self.config = config
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.faults = faults
        self._queues = queues
        self._on_finish = on_finish

    def append(self, verified: list[Verified], logits: torch.Tensor) -> None:
        """Appends each sequence's verified tokens; those of requests that asked for
        logprobs last, with the step's logprobs computed in one pass."""
        logprobs_jobs: list[tuple[Sequence, LogprobsJob]] = []
        for item in verified:
            seq = item.seq
            if seq.params.logprobs is not None:
                # Until appended, seq.token_ids is still the context before first_row: no
                # copy needed.
                logprobs_jobs.append((seq, LogprobsJob(item.first_row, item.token_ids,
                                                       seq.token_ids, seq.params, seq.prompt_len)))
                continue
            with self.faults.isolate(seq):
                self.append_tokens(seq, item.token_ids)
        if logprobs_jobs:
            self._append_with_logprobs(logits, logprobs_jobs)

    def _append_with_logprobs(self, logits: torch.Tensor,
                              jobs: list[tuple[Sequence, LogprobsJob]]) -> None:
        """Appends each job's tokens with their logprobs, computed in one pass; when that
        pass raises, one job at a time, so that only the failing sequence fails."""
        try:
            entries = step_logprobs(logits, [job for _, job in jobs], self.config.logprobs_mode,
                                    self.eos_token_ids)
        except Exception:  # retried per sequence below, each isolated
            entries = None
        for position, (seq, job) in enumerate(jobs):
            with self.faults.isolate(seq):
                seq_entries = (entries[position] if entries is not None else
                               step_logprobs(logits, [job], self.config.logprobs_mode,
                                             self.eos_token_ids)[0])
                self.append_tokens(seq, job.emitted_ids, seq_entries)

    def append_tokens(self, seq: Sequence, new_token_ids: list[int],
                       logprobs: list[TokenLogprobs] | None = None) -> None:
        """Appends verified tokens, stopping at the first stop condition, and streams them
        (with their logprobs, one per new token, when the request asked)."""
        params = seq.params
        visible: list[int] = []
        finish: FinishReason | None = None
        for token_id in new_token_ids:
            seq.token_ids.append(token_id)
            if (token_id in params.stop_token_ids
                    or (not params.ignore_eos and token_id in self.eos_token_ids)):
                # Counted in usage, not streamed: vLLM drops the stop token from the text.
                seq.num_hidden_output_tokens += 1
                finish = FinishReason.STOP
                break
            visible.append(token_id)
            if (seq.num_output_tokens >= params.max_tokens
                    or seq.num_tokens >= self.config.context_len):
                finish = FinishReason.LENGTH
                break
        # Before a finish frees them: the blocks of verified tokens outlive the request.
        self.scheduler.cache_computed_blocks(seq)
        queue = self._queues.get(seq.seq_id)
        output = RequestOutput(visible, finish, seq.prompt_len, seq.num_output_tokens, seq.spec,
                               None if logprobs is None else logprobs[:len(visible)],
                               seq.num_cached_tokens)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if finish is not None:
            self._on_finish(seq, finish)
        else:
            # Rejected drafts' slots go back to the pool.
            self.scheduler.block_manager.trim(seq, seq.num_tokens)
        if queue is not None:
            queue.put_nowait(output)
