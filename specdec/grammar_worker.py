"""The process `GrammarChecker` runs grammar checks in (`python -m specdec.grammar_worker`).

One JSON line in per check ({"kind", "value", "param", "max_chars"}), one JSON line out:
{"text": llguidance's grammar} when it compiles, {"invalid": message} when it does not (a
400 naming the request's field), {"error": message} for anything else. The process holds
nothing between checks, so the checker can kill it at any time (a check past its time
budget, a request that ended) and start another. It runs at a lower CPU priority: a flood
of expensive checks yields the CPU to the server's own work (templating, the forward).
"""

from __future__ import annotations

import json
import os
import sys

from specdec.errors import InvalidRequestError
from specdec.grammar_spec import check_grammar


def check_one(request: dict) -> dict:
    try:
        text = check_grammar(request["kind"], request["value"], param=request["param"],
                             max_chars=request["max_chars"])
    except InvalidRequestError as error:
        return {"invalid": error.message}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"[:400]}
    return {"text": text}


# Added to the server's niceness (0-19 on Linux: higher yields the CPU).
NICENESS = 10


def main() -> None:
    os.nice(NICENESS)
    for line in sys.stdin:
        sys.stdout.write(json.dumps(check_one(json.loads(line))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
