"""The services' heap and Python's cyclic garbage collector.

A full collection walks every object the collector tracks. After start-up most of them are
there for good (modules, the model's parameters and modules, the tokenizer: about a million
objects in the verifier), and walking them made the services' full collections take
150-210 ms each: a stall of every sequence in the verifier's step, and in a drafter longer
than the verifier's draft deadline. `freeze_startup_heap` moves what is alive once a
service is up into the collector's permanent generation, so later collections walk only
what was made since; the frozen objects are still freed by reference counting when they go.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects once, then freezes every object alive; returns how many were frozen. Called
    once a service has loaded what it keeps (not by tests that start services in-process)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
