"""specdec.heap: what a service has loaded at start-up is out of the collector's walks."""

from __future__ import annotations

import gc

from specdec.heap import freeze_startup_heap


class _Held:
    pass


def test_frozen_objects_leave_the_collected_generations_and_are_still_freed() -> None:
    held = [_Held() for _ in range(1000)]
    try:
        frozen = freeze_startup_heap()
        assert frozen >= 1000
        tracked = {id(obj) for obj in gc.get_objects()}
        assert not any(id(obj) in tracked for obj in held)
        # Reference counting still frees them: nothing frozen is kept alive by the freeze.
        before = gc.get_freeze_count()
        del held
        assert gc.get_freeze_count() <= before - 1000
    finally:
        gc.unfreeze()
