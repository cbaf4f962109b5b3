"""A replay stream (`bench replay`): requests, each its prompt ids and the target's answer
ids, stored as JSONL."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class StreamRequest:
    prompt_ids: list[int]
    answer_ids: list[int]


def load_stream(path: Path) -> list[StreamRequest]:
    """A JSONL file of {"prompt_ids": [...], "answer_ids": [...]} lines."""
    stream = []
    for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            stream.append(StreamRequest([int(t) for t in fields["prompt_ids"]],
                                        [int(t) for t in fields["answer_ids"]]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} line {number}: want {{\"prompt_ids\": [...], "
                             f"\"answer_ids\": [...]}}: {exc}") from None
    return stream


def save_stream(stream: Sequence[StreamRequest], path: Path) -> None:
    path.write_text("".join(json.dumps(asdict(request)) + "\n" for request in stream), "utf-8")
