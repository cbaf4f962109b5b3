"""Every process a launched stack made, found by a mark in its environment.

The launcher's children lead sessions of their own and may leave processes of their own
(a compiler, a worker) that outlive them; all of them inherit the launcher's environment,
so a variable set there alone names the whole stack, whoever their parent is now.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

MARK_ENV = "SPECDEC_TEST_STACK_MARK"


def new_mark() -> str:
    return uuid.uuid4().hex


def processes_marked(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries `mark`."""
    needle = f"{MARK_ENV}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != "Z":  # a zombie has ended; only its parent's wait is missing
            found.append((int(entry.name), command.strip()))
    return found
