"""Moves the weights a CPU forward streams into one huge-page buffer, in the order it reads them.

Why: a decode step reads every weight once, and on the CPU it is bound by how fast it does.
Loaded one by one, the default model's 121 matrices sit in separate 4 KiB-page allocations:
each 4 KiB page costs a TLB miss and each call starts its streams cold. Measured here (2
cores, the C++ linear over the 30 layers and the LM head, one row, median of 15, same run):
bf16 5.0 -> 4.4 ms, fp32 9.0 -> 8.3 ms once the same weights sit in one buffer that the
kernel is asked to back with 2 MiB pages (`madvise(MADV_HUGEPAGE)`, which Linux's default
`transparent_hugepage=madvise` honours), laid out in reading order.

`move_into_arena` copies each tensor into the buffer and points every tensor object that
shared its storage (a parameter, a packed alias, a tied embedding) at the copy, so the model,
its packed linears and anything built from them afterwards read the buffer. Values do not
change. Where huge pages are not available the buffer is still one contiguous,
2 MiB-aligned allocation.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence

import torch

from specdec.heap import return_free_heap

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# Each tensor starts on a cache line.
ALIGN_BYTES = 64


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def move_into_arena(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Moves `tensors` (CPU, contiguous, in reading order) into one huge-page buffer.

    Tensor objects that are the same data (same address, shape and dtype: a parameter and
    its detached alias, a tied embedding) are moved together, once, where the first of them
    stands in the order. Returns the buffer (uint8), which the moved tensors keep alive;
    None when there is nothing to move.
    """
    groups: dict[tuple[int, tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("move_into_arena takes contiguous CPU tensors")
        groups.setdefault((tensor.data_ptr(), tuple(tensor.shape), tensor.dtype), []).append(tensor)
    if not groups:
        return None
    sizes = [group[0].numel() * group[0].element_size() for group in groups.values()]
    total = sum(_round_up(size, ALIGN_BYTES) for size in sizes)
    # One huge page of slack, to align the start.
    buffer = mmap.mmap(-1, _round_up(total, HUGE_PAGE_BYTES) + HUGE_PAGE_BYTES,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = hasattr(mmap, "MADV_HUGEPAGE")
    if huge:
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            huge = False
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    offset = (-flat.data_ptr()) % HUGE_PAGE_BYTES
    arena = flat[offset:offset + total]
    start = 0
    with torch.no_grad():
        for group, size in zip(groups.values(), sizes):
            first = group[0]
            placed = arena[start:start + size].view(first.dtype).view(first.shape)
            placed.copy_(first)
            for tensor in group:
                tensor.data = placed
            start += _round_up(size, ALIGN_BYTES)
    return_free_heap()  # the copies' old storage, freed as each tensor moved
    logger.info("weights: %d tensors (%.1f MiB) in one %s buffer, in reading order",
                len(groups), total / 2**20, "huge-page" if huge else "2 MiB-aligned")
    return arena

