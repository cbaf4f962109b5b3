"""`python -m specdec.bench.scale_memory`'s readings and the wrappers that take them."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from specdec.bench.scale_memory import Steps, memory_mb


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc")
def test_memory_reads_the_process_status() -> None:
    values = memory_mb()
    assert values["rss"] > 0 and values["peak"] >= values["rss"]
    assert abs(values["anon"] + values["file"] + values["shmem"] - values["rss"]) < 1


def test_steps_mark_around_the_wrapped_calls_and_keep_classes_classes() -> None:
    class Reader:
        def __init__(self, name: str) -> None:
            self.name = name

    owner = types.SimpleNamespace(Reader=Reader, load=lambda value: value * 2)
    steps = Steps()
    steps.after(owner, "Reader", "reader opened")
    steps.after(owner, "load", "loaded", before="loading", once=True)
    reader = owner.Reader("file")
    assert isinstance(reader, owner.Reader) and isinstance(reader, Reader) and reader.name == "file"
    assert owner.load(3) == 6 and owner.load(4) == 8
    assert [name for name, _ in steps.rows] == ["reader opened", "loading", "loaded"]
    table = steps.table(455.0)
    assert "| loaded |" in table and "file: 455 MB" in table
