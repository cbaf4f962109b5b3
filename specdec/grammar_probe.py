"""A compiled grammar's admission probe: a short walk that llguidance's limits must survive.

llguidance builds a grammar's lexer states lazily, so a grammar can compile and still go
past its limits (lexer states, fuel, parser rows) at a later token: `(a{1000}){1000}` at
its first, a 20,000-string choice at its first mask, `/[0-9]{30}/ " " /(a{1000}){1000}/`
at its 31st. `probe_matcher` walks the grammar for `PROBE_DEPTH` tokens (at each step the
lowest allowed id that is not EOS), rolls the walk back and asks for the first mask again,
so what fails in the first tokens, in a mask or in a rollback is refused before admission.
Later failures stay possible; they fail their own sequence alone
(`verifier_svc/sequence_faults.py`). Torch-free: it runs in the grammar worker process too.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from specdec.errors import InvalidRequestError

# A mask costs at most llguidance's step fuel (~15 ms); a typical one well under 1 ms.
PROBE_DEPTH = 16
MAX_ERROR_CHARS = 300
# llguidance's error for a grammar with no way to go on (from its start: one that matches
# nothing, e.g. a schema whose $ref cycle has no base case).
_NO_OUTPUT_ERROR = "NoExtensionBias"


def probe_matcher(matcher: Any, kind: str, *, tokenizer_vocab_size: int,
                  eos_token_ids: Collection[int], depth: int = PROBE_DEPTH) -> None:
    """Raises InvalidRequestError (param `grammar`) when `matcher` (an llguidance LLMatcher
    at its start; moved and put back) fails within `depth` tokens of its start."""
    what = kind.replace("_", " ")
    first_mask = _mask(matcher, what)
    mask = first_mask
    num_taken = 0
    while num_taken < depth:
        token_id = _lowest_allowed(mask, tokenizer_vocab_size, eos_token_ids)
        if token_id is None:
            break  # only EOS (or nothing) may follow: the walk ends here
        matcher.consume_token(token_id)
        _raise_on_error(matcher, what)
        num_taken += 1
        mask = _mask(matcher, what)
    if num_taken and not matcher.rollback(num_taken):
        _raise_on_error(matcher, what)
        raise InvalidRequestError(f"the {what} cannot be rolled back by the grammar library",
                                  param="grammar")
    _mask(matcher, what)


def _mask(matcher: Any, what: str) -> int:
    """The allowed ids now, as an int (bit i set: id i allowed)."""
    mask = int.from_bytes(matcher.compute_bitmask(), "little")
    _raise_on_error(matcher, what)
    return mask


def _lowest_allowed(mask: int, tokenizer_vocab_size: int,
                    eos_token_ids: Collection[int]) -> int | None:
    mask &= (1 << tokenizer_vocab_size) - 1  # the model's padding ids are never taken
    for token_id in eos_token_ids:
        mask &= ~(1 << token_id)
    return (mask & -mask).bit_length() - 1 if mask else None


def error_detail(error: str) -> str:
    """llguidance's error, on one line and short (past its first line it may quote the
    grammar)."""
    lines = error.strip().splitlines()
    return (lines[0] if lines else "unknown error")[:MAX_ERROR_CHARS]


def _raise_on_error(matcher: Any, what: str) -> None:
    if not matcher.is_error():
        return
    detail = error_detail(matcher.get_error())
    if detail.startswith(_NO_OUTPUT_ERROR):
        raise InvalidRequestError(f"the {what} matches no text at all (a $ref that only "
                                  "refers to itself?)", param="grammar")
    raise InvalidRequestError(f"the {what} exceeds the grammar library's limits: {detail}",
                              param="grammar")
