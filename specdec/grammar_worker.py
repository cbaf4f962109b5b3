"""The process `GrammarChecker` runs grammar checks in (`python -m specdec.grammar_worker`).

Its first line in is its set-up, {"tokenizer": a `GrammarTokenizer`'s JSON or null}; it
answers {"ready": true} once its llguidance tokenizer is built. Then one JSON line in per
check ({"kind", "value", "param", "max_chars"}), one JSON line out: {"text": llguidance's
grammar} when it compiles, {"invalid": message} when it does not (a 400 naming the
request's field), {"error": message} for anything else.

Without a tokenizer (the gateway's) a check is llguidance's validation of the grammar.
With the model's tokenizer (the verifier's) it is all the work the verifier's admission
does: the matcher's compile and its probe (`specdec.grammar_probe`), so a grammar that
passes is rebuilt in-process at no more than the cost the budget allowed here, and is not
probed again. The process holds nothing between checks, so the checker can kill it at any
time (a check past its time budget, a request that ended) and start another. It runs at a
lower CPU priority: a flood of expensive checks yields the CPU to the server's own work
(templating, the forward).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from specdec.errors import InvalidRequestError
from specdec.grammar_probe import probe_matcher
from specdec.grammar_spec import check_grammar, compiled_matcher, grammar_text
from specdec.grammar_tokenizer import GrammarTokenizer


class Checker:
    """One check at a time, with or without the model's tokenizer."""

    def __init__(self, tokenizer: GrammarTokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.ll_tokenizer = tokenizer.build() if tokenizer is not None else None

    def check_one(self, request: dict) -> dict:
        try:
            return {"text": self._check(request["kind"], request["value"], request["param"],
                                        request["max_chars"])}
        except InvalidRequestError as error:
            return {"invalid": error.message}
        except Exception as error:
            return {"error": f"{type(error).__name__}: {error}"[:400]}

    def _check(self, kind: str, value: str, param: str, max_chars: int) -> str:
        if self.tokenizer is None:
            return check_grammar(kind, value, param=param, max_chars=max_chars)
        text = grammar_text(kind, value, param=param, max_chars=max_chars)
        probe_matcher(compiled_matcher(kind, text, self.ll_tokenizer), kind,
                      tokenizer_vocab_size=self.tokenizer.tokenizer_vocab_size,
                      eos_token_ids=self.tokenizer.eos_token_ids)
        return text


def _write(reply: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


# Added to the server's niceness (0-19 on Linux: higher yields the CPU).
NICENESS = 10


def main() -> None:
    os.nice(NICENESS)
    setup = json.loads(sys.stdin.readline())
    fields = setup.get("tokenizer")
    checker = Checker(GrammarTokenizer.from_json(fields) if fields else None)
    _write({"ready": True})
    for line in sys.stdin:
        _write(checker.check_one(json.loads(line)))


if __name__ == "__main__":
    main()
