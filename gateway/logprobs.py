"""Logprobs in OpenAI's shapes, from the verifier's per-token entries.

Chat: `choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}]}`. Completions (legacy): `{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}`.

A token's text is the token on its own, and its bytes are the exact bytes it stands for:
with a byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM2) a token may hold part of a
UTF-8 character, which decoding it alone cannot show, so the bytes come from the
vocabulary's byte alphabet and the text from those bytes (invalid parts replaced).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from specdec.v1 import specdec_pb2


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (transformers' own table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenTexts:
    """Token id -> (text, bytes), computed once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        special = getattr(tokenizer, "all_special_ids", None) or ()
        self._special_ids = frozenset(special)

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = self._compute(token_id)
        return entry

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = None
        if token_id not in self._special_ids:
            try:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
            except Exception:
                piece = None
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece and all(char in decoder for char in piece):
            raw = bytes(decoder[char] for char in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self._tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def chat_logprobs_content(entries: Sequence[specdec_pb2.TokenLogprob], token_ids: Sequence[int],
                          texts: TokenTexts) -> list[dict]:
    """`logprobs.content` items for `token_ids` (one entry each)."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        text, raw = texts(token_id)
        top = []
        for top_id, top_logprob in zip(entry.top_token_ids, entry.top_logprobs):
            top_text, top_raw = texts(top_id)
            top.append({"token": top_text, "logprob": _finite(top_logprob), "bytes": top_raw})
        content.append({"token": text, "logprob": _finite(entry.logprob), "bytes": raw,
                        "top_logprobs": top})
    return content


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built up chunk by chunk (text_offset
    counts characters from the start of the completion's text)."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self.offset = 0

    def build(self, entries: Sequence[specdec_pb2.TokenLogprob],
              token_ids: Sequence[int]) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text, _ = self._texts(token_id)
            tokens.append(text)
            token_logprobs.append(_finite(entry.logprob))
            top = {self._texts(top_id)[0]: _finite(value)
                   for top_id, value in zip(entry.top_token_ids, entry.top_logprobs)}
            top.setdefault(text, _finite(entry.logprob))  # the sampled token, as OpenAI
            top_logprobs.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}


def _finite(value: float) -> float:
    """JSON has no -Infinity: a token masked out (processed logprobs) reports vLLM's -9999."""
    return value if value > -9999.0 else -9999.0
