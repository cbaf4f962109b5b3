"""Incremental detokenization and stop strings.

Byte-level tokenizers split multi-byte characters across tokens: decoding a prefix that
ends inside a character yields U+FFFD. `IncrementalDetokenizer` only releases text once
the trailing character is complete (vLLM's prefix/read offset scheme), so a stream never
carries a partial character. `StopStringMatcher` holds back any suffix that could still
grow into a stop string, so the client never sees the beginning of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context: sentencepiece-style decoders drop a leading space
# when a token is decoded alone, so decoding always starts a few tokens earlier.
NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Invariant: `token_ids[prefix_offset:read_offset]` decodes to text already released;
    `token_ids[read_offset:]` is pending. Example with "é" = bytes C3 A9 as two tokens:
    push([C3]) decodes to "\ufffd" and returns ""; push([A9]) returns "é".
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only slow (Python) tokenizers read it; fast ones never put spaces there (as in vLLM).
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids, skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens)

    def _pending_text(self) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""
        return full_text[len(prefix_text):]

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the newly complete text (possibly "")."""
        self._token_ids.extend(token_ids)
        new_text = self._pending_text()
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text

    def flush(self) -> str:
        """At the end of generation: releases what is pending, even an invalid sequence."""
        new_text = self._pending_text()
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return new_text


class StopStringMatcher:
    """Cuts text at the first stop string (after it with `include_stop`, vLLM's
    include_stop_str_in_output) and holds back possible stop-string prefixes."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to release, whether a stop string was found)."""
        if self.stopped:
            return "", True
        if not self._stop:
            return text, False
        self._pending += text
        # The stop string that completes first wins (then the longer one), as if the
        # text arrived one character at a time: the cut never depends on the chunking.
        matches = [(index + len(stop), index) for stop in self._stop
                   if (index := self._pending.find(stop)) >= 0]
        if matches:
            end, start = min(matches)
            cut = end if self._include_stop else start
            self.stopped = True
            released, self._pending = self._pending[:cut], ""
            return released, True
        hold = self._longest_stop_prefix_suffix()
        released = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return released, False

    def flush(self) -> str:
        """Generation ended without a stop string: the held text is ordinary output."""
        released, self._pending = self._pending, ""
        return released

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest suffix of the pending text that starts some stop string."""
        pending = self._pending
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest
