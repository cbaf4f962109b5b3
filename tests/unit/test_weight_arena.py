"""`move_into_arena`: the weights a CPU forward streams, moved into one buffer in reading
order, values and aliases kept, and their old memory given back to the system."""

from __future__ import annotations

import sys

import pytest
import torch

from specdec.heap import return_free_heap
from specdec.models.weight_arena import move_into_arena


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_values_and_aliases_are_kept_in_one_buffer() -> None:
    weights = [torch.randn(33, 17), torch.randn(5).to(torch.bfloat16), torch.randn(64, 64)]
    alias = weights[0].detach()  # a second tensor object on the same storage, as a packed alias
    expected = [w.clone() for w in weights]
    arena = move_into_arena([*weights, alias])
    assert arena is not None
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    for weight, value in zip(weights, expected):
        assert torch.equal(weight, value) and weight.dtype == value.dtype
        assert start <= weight.data_ptr() < end and weight.data_ptr() % 64 == 0
    assert alias.data_ptr() == weights[0].data_ptr()  # moved once, still shared
    assert weights[0].data_ptr() < weights[1].data_ptr() < weights[2].data_ptr()  # reading order


def test_non_contiguous_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        move_into_arena([torch.randn(8, 8).t()])
    assert move_into_arena([]) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_moved_weights_old_memory_is_given_back() -> None:
    # Weights of 96 KiB each (glibc's heap, not their own mappings) with small tensors kept
    # between them, so that the freed weights are holes in the heap: glibc keeps those
    # resident unless they are handed back.
    count, numel = 640, 24 * 1024
    weights, keepers = [], []
    return_free_heap()  # so that what earlier tests freed is not reused without being touched
    before = _rss_anon_bytes()
    for _ in range(count):
        weights.append(torch.ones(numel))
        keepers.append(torch.ones(16))
    held = count * numel * 4  # 60 MiB
    assert _rss_anon_bytes() - before > 0.9 * held
    move_into_arena(weights)
    # The arena holds one copy; the old one is gone (without it: about 2x).
    assert _rss_anon_bytes() - before < 1.4 * held
    assert all(torch.equal(w, torch.ones(numel)) for w in weights[::97])
