"""Per-sequence grammar state for verification under a grammar (llguidance's LLMatcher).

Token bitmasks are int32 tensors [rows, ceil(vocab / 32)], bit `id % 32` of word `id // 32`
set when token `id` is allowed (llguidance's layout). Ids at or past the tokenizer's size
(the model's vocabulary padding) are never allowed.

EOS is handled here, not inside the llguidance matcher: the grammar allows EOS exactly when
it is satisfied (`is_accepting`), and accepting EOS only sets a flag, so that a rollback over
it is exact (llguidance's state after rolling back a consumed EOS is not the state before).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specdec.errors import InvalidRequestError
from specdec.grammar_probe import error_detail

logger = logging.getLogger(__name__)


class GrammarLimitError(InvalidRequestError):
    """The grammar went past the grammar library's limits (parser rows, lexer states, fuel)
    while generating: llguidance's matcher is in its error state for good."""

    def __init__(self, detail: str) -> None:
        self.detail = error_detail(detail)
        super().__init__("the grammar exceeded the grammar library's limits while generating: "
                         f"{self.detail}", param="grammar")


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask [rows, ceil(vocab_size / 32)], every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from an int32 bitmask [rows, words] (on the bitmask's device)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:
        # Fewer words than the vocabulary: the rest is padding, never allowed.
        pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool,
                          device=bitmask.device)
        allowed = torch.cat([allowed, pad], dim=1)
    return allowed[:, :vocab_size]


def apply_masks(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`logits` [n, vocab] with -inf where `mask` forbids, in place (also returned).

    `mask` is a bool [n, vocab] (True = allowed) or an int32 bitmask [n, words]; it is
    moved to the logits' device. Rows past the mask's rows are left alone; columns past the
    bitmask's width are forbidden.
    """
    rows = min(logits.shape[0], mask.shape[0])
    if rows == 0:
        return logits
    if (mask.dtype == torch.int32 and logits.device.type == "cpu" and logits.dtype == torch.float32
            and not mask.is_cuda):
        _apply_bitmask_cpu(logits[:rows].numpy(), mask[:rows].numpy())
        return logits
    if mask.dtype != torch.bool:
        mask = bitmask_to_bool(mask[:rows].to(logits.device, non_blocking=True), logits.shape[-1])
    else:
        mask = mask[:rows, : logits.shape[-1]].to(logits.device, non_blocking=True)
    logits[:rows, : mask.shape[1]].masked_fill_(~mask, float("-inf"))
    logits[:rows, mask.shape[1]:] = float("-inf")
    return logits


_BIT_OFFSETS = np.arange(32, dtype=np.int64)


def _word_bits(words: np.ndarray) -> np.ndarray:
    """bool [m, 32]: bit b of each int32 word (little-endian, llguidance's order)."""
    as_bytes = np.ascontiguousarray(words, dtype="<i4").view(np.uint8).reshape(-1, 4)
    return np.unpackbits(as_bytes, axis=1, bitorder="little").astype(bool)


def _apply_bitmask_cpu(logits: np.ndarray, words: np.ndarray) -> None:
    """The bitmask applied word at a time (numpy, in place).

    torch's masked_fill over a 49k vocabulary costs ~0.15-0.3 ms a row on one CPU core. A
    grammar's mask is mostly whole words of 0 (32 ids forbidden) or -1 (32 allowed), so
    this touches only the ids on each row's cheaper side: in a row that allows few ids
    (keys, numbers, enums) they are saved, the row filled with -inf and they are put back;
    in a row that allows most (string content) only the forbidden ones are set.
    """
    rows, vocab = logits.shape
    width = words.shape[1]
    span = min(vocab, width * 32)
    if vocab > span:
        logits[:, span:] = -np.inf  # past the mask: never allowed
    zero = words == 0
    full = words == -1
    mixed_rows, mixed_words = np.nonzero(~(zero | full))
    if len(mixed_rows) * 4 > words.size:
        # Bits all over the place (not a grammar's usual mask): unpack every bit.
        bits = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8),
                             axis=1, bitorder="little")
        np.copyto(logits[:, :span], -np.inf, where=bits[:, :span] == 0)
        return
    mixed_bits = _word_bits(words[mixed_rows, mixed_words])
    mixed_cols = mixed_words[:, None] * 32 + _BIT_OFFSETS
    mixed_rows_2d = np.broadcast_to(mixed_rows[:, None], mixed_cols.shape)
    allowed = full.sum(axis=1) * 32 + np.bincount(mixed_rows, weights=mixed_bits.sum(axis=1),
                                                  minlength=rows)
    sparse = allowed * 2 < span
    if sparse.any():
        in_sparse = sparse[mixed_rows]
        full_rows, full_words = np.nonzero(full & sparse[:, None])
        keep = mixed_bits & in_sparse[:, None]
        keep_rows = np.concatenate([np.repeat(full_rows, 32), mixed_rows_2d[keep]])
        keep_cols = np.concatenate([(full_words[:, None] * 32 + _BIT_OFFSETS).ravel(),
                                    mixed_cols[keep]])
        inside = keep_cols < vocab
        keep_rows, keep_cols = keep_rows[inside], keep_cols[inside]
        saved = logits[keep_rows, keep_cols]
        logits[np.flatnonzero(sparse), :span] = -np.inf
        logits[keep_rows, keep_cols] = saved
    if not sparse.all():
        dense = ~sparse
        zero_rows, zero_words = np.nonzero(zero & dense[:, None])
        drop = ~mixed_bits & dense[mixed_rows][:, None]
        drop_rows = np.concatenate([np.repeat(zero_rows, 32), mixed_rows_2d[drop]])
        drop_cols = np.concatenate([(zero_words[:, None] * 32 + _BIT_OFFSETS).ravel(),
                                    mixed_cols[drop]])
        inside = drop_cols < vocab
        logits[drop_rows[inside], drop_cols[inside]] = -np.inf


def _single_allowed(row: torch.Tensor) -> int | None:
    """The one allowed id of a (CPU) bitmask row, or None when zero or several are allowed."""
    words = row.numpy()
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    index = int(nonzero[0])
    word = int(words[index]) & 0xFFFFFFFF
    if word & (word - 1):
        return None  # several bits set in the one word
    return index * 32 + word.bit_length() - 1


class GrammarState:
    """The grammar's state for one sequence: what it has accepted, what it allows next.

    Not thread-safe: one sequence is advanced by one engine step at a time.
    """

    def __init__(self, matcher: Any, *, tokenizer_vocab_size: int, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher  # llguidance.LLMatcher, a fresh copy for this sequence
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos_accepted = False
        self.num_accepted = 0  # tokens accepted and not rolled back (EOS included)
        self._scratch = allocate_bitmask(1, vocab_size)

    # -- state ---------------------------------------------------------------------------
    def is_accepting(self) -> bool:
        """The text so far satisfies the grammar: EOS is allowed now."""
        return self._eos_accepted or self._matcher.is_accepting()

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar rejects it."""
        if self._eos_accepted:
            return False
        if token_id in self.eos_token_ids:
            if not self._matcher.is_accepting():
                return False
            self._eos_accepted = True
            self.num_accepted += 1
            return True
        if not 0 <= token_id < self.tokenizer_vocab_size:
            return False
        # validate first: a rejected consume_token leaves the matcher in an error state forever.
        if self._matcher.validate_tokens([token_id]) != 1:
            self._check_limits()
            return False
        if not self._matcher.consume_token(token_id):  # after validate_tokens: a limit only
            self._check_limits()
            raise RuntimeError("grammar matcher failed on a validated token")
        self.num_accepted += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Accept tokens in order until one is rejected; how many were accepted."""
        for count, token_id in enumerate(token_ids):
            if not self.accept(token_id):
                return count
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. drafts the target rejected)."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens == 0:
            return
        matcher_tokens = num_tokens
        if self._eos_accepted:
            self._eos_accepted = False
            matcher_tokens -= 1
        if matcher_tokens and not self._matcher.rollback(matcher_tokens):
            self._check_limits()
            raise RuntimeError("grammar matcher rollback failed")
        self.num_accepted -= num_tokens

    # -- drafts --------------------------------------------------------------------------
    def valid_prefix_len(self, draft_ids: Sequence[int]) -> int:
        """How many leading draft tokens the grammar accepts; the state is unchanged."""
        if self._eos_accepted:
            return 0
        count = 0
        for token_id in draft_ids:
            if not 0 <= token_id < self.tokenizer_vocab_size:
                break
            count += 1
        tokens = list(draft_ids[:count])
        # Only an EOS can end the run inside the tokenizer's range without llguidance's
        # help: validate the tokens before the first EOS, then the EOS by hand.
        eos_at = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), None)
        if eos_at is None:
            valid = self._matcher.validate_tokens(tokens) if tokens else 0
            self._check_limits()
            return valid
        valid = self._matcher.validate_tokens(tokens[:eos_at]) if eos_at else 0
        self._check_limits()
        if valid < eos_at:
            return valid
        if not eos_at:
            return 1 if self._matcher.is_accepting() else 0
        # Whether EOS may follow needs the state after the tokens before it: step in, look,
        # step back.
        if not self._matcher.consume_tokens(tokens[:eos_at]):
            self._check_limits()
            raise RuntimeError("grammar matcher failed on validated tokens")
        accepting = self._matcher.is_accepting()
        if not self._matcher.rollback(eos_at):
            self._check_limits()
            raise RuntimeError("grammar matcher rollback failed")
        return eos_at + 1 if accepting else eos_at

    def fill_next_mask(self, out: torch.Tensor, row: int = 0) -> None:
        """Row `row` of the int32 bitmask `out` = tokens allowed now."""
        target = out[row]
        if self._eos_accepted:
            # Finished: the engine stops the sequence before sampling again. EOS alone keeps
            # the row's logits finite for a verifier that scores every row.
            self._eos_only(target)
            return
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        self._check_limits()
        self._clear_padding(target)

    def fill_masks(self, draft_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Bitmask [len(draft)+1, words]: row i = tokens allowed after the drafts before i.

        The verifier applies row i to the target's logits at position i. Rows after the
        first draft the grammar rejects repeat that draft's row (the target rejects that
        draft there, so those rows are never used; repeating keeps their logits finite);
        rows after a draft EOS allow EOS alone.
        The state is unchanged afterwards. `out` (CPU, contiguous rows) is filled in place
        when given, else allocated.
        """
        rows = len(draft_ids) + 1
        if out is None:
            out = allocate_bitmask(rows, self.vocab_size)
        consumed = 0
        eos_taken = False
        try:
            for i in range(rows):
                self.fill_next_mask(out, i)
                if i == len(draft_ids):
                    break
                token_id = draft_ids[i]
                if not self.accept(token_id):
                    out[i + 1:rows] = out[i]
                    break
                if token_id in self.eos_token_ids:
                    eos_taken = True
                consumed += 1
                if eos_taken:
                    for later in range(i + 1, rows):
                        self._eos_only(out[later])
                    break
        finally:
            self.rollback(consumed)
        return out

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """Tokens the grammar forces next: each the ONLY allowed token at its position.

        Proposing them as drafts is exact with greedy and sampled verification alike: the
        masked target distribution puts all its mass on the forced token. EOS is never
        returned (a terminated grammar finishes the sequence instead). State unchanged.
        """
        forced: list[int] = []
        try:
            while len(forced) < max_tokens and not self._eos_accepted:
                self.fill_next_mask(self._scratch, 0)
                token_id = _single_allowed(self._scratch[0])
                if token_id is None or token_id in self.eos_token_ids:
                    break
                if not self.accept(token_id):
                    break
                forced.append(token_id)
        finally:
            self.rollback(len(forced))
        return forced

    def _check_limits(self) -> None:
        """Raises GrammarLimitError when the matcher is in its error state (a limit hit)."""
        if self._matcher.is_error():
            raise GrammarLimitError(self._matcher.get_error())

    def _eos_only(self, row: torch.Tensor) -> None:
        row.zero_()
        for token_id in self.eos_token_ids:
            bit = 1 << (token_id % 32)
            word = int(row[token_id // 32]) | bit
            row[token_id // 32] = word - (1 << 32) if word >= (1 << 31) else word

    def _clear_padding(self, row: torch.Tensor) -> None:
        """Forbid ids at or past the tokenizer's size (the model's padding ids)."""
        first = self.tokenizer_vocab_size
        if first >= row.numel() * 32:
            return
        word = first // 32
        bit = first % 32
        if bit:
            keep = (1 << bit) - 1
            value = int(row[word]) & keep
            row[word] = value - (1 << 32) if value >= (1 << 31) else value
            word += 1
        row[word:] = 0
