"""The model's tokenizer as llguidance needs it, in a form a grammar worker process can take.

The verifier builds its in-process llguidance tokenizer and its grammar workers' from the
same `GrammarTokenizer` (the tokenizers library's JSON, the model's logits width, the EOS
ids), so a grammar a worker compiled and probed compiles and behaves the same in-process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GrammarTokenizer:
    tokenizer_json: str  # the tokenizers library's serialization (~1.5 MB for 49k tokens)
    vocab_size: int  # the model's logits width (may exceed the tokenizer's size)
    tokenizer_vocab_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, tokenizer: Any, vocab_size: int,
                eos_token_ids: tuple[int, ...]) -> GrammarTokenizer:
        """From a transformers fast tokenizer; raises ValueError for a slow one."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("only fast tokenizers are supported")
        backend = copy.copy(backend)  # padding and truncation off on a copy, as llguidance.hf
        backend.no_padding()
        backend.no_truncation()
        return cls(tokenizer_json=backend.to_str(), vocab_size=vocab_size,
                   tokenizer_vocab_size=len(tokenizer), eos_token_ids=eos_token_ids)

    def build(self) -> Any:
        """llguidance's LLTokenizer (~0.7 s for 49k tokens)."""
        import llguidance

        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                      eos_token=list(self.eos_token_ids) or None)

    def to_json(self) -> dict[str, Any]:
        return {"tokenizer_json": self.tokenizer_json, "vocab_size": self.vocab_size,
                "tokenizer_vocab_size": self.tokenizer_vocab_size,
                "eos_token_ids": list(self.eos_token_ids)}

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> GrammarTokenizer:
        return cls(tokenizer_json=fields["tokenizer_json"], vocab_size=fields["vocab_size"],
                   tokenizer_vocab_size=fields["tokenizer_vocab_size"],
                   eos_token_ids=tuple(fields["eos_token_ids"]))
