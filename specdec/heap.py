"""The services' heap: Python's cyclic garbage collector, and glibc's free pages.

A full collection walks every object the collector tracks. After start-up most of them are
there for good (modules, the model's parameters and modules, the tokenizer: about a million
objects in the verifier), and walking them made the services' full collections take
150-210 ms each: a stall of every sequence in the verifier's step, and in a drafter longer
than the verifier's draft deadline. `freeze_startup_heap` moves what is alive once a
service is up into the collector's permanent generation, so later collections walk only
what was made since; the frozen objects are still freed by reference counting when they go.

`return_free_heap` hands glibc's free heap pages back to the system: loading a model and
moving its weights free temporaries and copies of tens of MB, which glibc keeps in its heap,
resident (700 MB at 0.8B in bf16).
"""

from __future__ import annotations

import ctypes
import gc


def freeze_startup_heap() -> int:
    """Collects once, then freezes every object alive; returns how many were frozen. Called
    once a service has loaded what it keeps (not by tests that start services in-process)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def return_free_heap() -> bool:
    """`malloc_trim(0)`: glibc's free heap pages back to the system. Whether it ran (a no-op
    without glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
