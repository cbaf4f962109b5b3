"""Q4_K and Q6_K quantisation in numpy, for writing test and benchmark models.

The `gguf` package quantises Q8_0, Q4_0 and Q4_1 but only dequantises the K-quants; where
llama.cpp's own quantiser (llama-cpp-python) is not installed, `bench scale` writes Q4_K_M
with these. They round each group's scale and min from its range (no search for the scale
that minimises the error, as llama.cpp's does), so a file they write is a valid Q4_K_M of
slightly higher error; the block layouts are `specdec.models.gguf_blocks`'s.
"""

from __future__ import annotations

import numpy as np

def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _steps(values: np.ndarray, step: np.ndarray) -> np.ndarray:
    """values / step rounded to the nearest integer (0 where the step is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(step > 0, np.rint(values / np.where(step > 0, step, 1)), 0)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> Q4_K blocks, uint8 [n, k / 256 * 144]."""
    num_rows = rows.shape[0]
    groups = rows.astype(np.float32).reshape(-1, 8, 32)  # [super-blocks, groups, 32]
    low = np.minimum(groups.min(axis=-1), 0)
    scales = (groups.max(axis=-1) - low) / 15  # >= 0
    mins = -low  # >= 0
    d = _f16(scales.max(axis=-1) / 63)
    dmin = _f16(mins.max(axis=-1) / 63)
    sc = np.clip(_steps(scales, d.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(_steps(mins, dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    group_scale = d.astype(np.float32)[:, None] * sc
    group_min = dmin.astype(np.float32)[:, None] * m
    codes = np.clip(_steps(groups + group_min[..., None], group_scale[..., None]), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
    ], axis=-1)
    pairs = codes.reshape(-1, 4, 2, 32)  # 32 bytes hold a group in the low nibbles, the next in the high
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed_scales, qs], axis=-1)
    return blocks.reshape(num_rows, -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> Q6_K blocks, uint8 [n, k / 256 * 210]."""
    num_rows = rows.shape[0]
    groups = rows.astype(np.float32).reshape(-1, 16, 16)
    scales = np.abs(groups).max(axis=-1) / 31
    d = _f16(scales.max(axis=-1) / 127)
    sc = np.clip(_steps(scales, d.astype(np.float32)[:, None]), 0, 127).astype(np.int8)
    group_scale = d.astype(np.float32)[:, None] * sc
    codes = (np.clip(_steps(groups, group_scale[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 8, 32)
    # Input 32 r + c: low 4 bits in byte 64 (r // 4) + 32 (r % 2) + c, nibble (r % 4) // 2;
    # high 2 bits in byte 32 (r // 4) + c, bits 2 (r % 4).
    ql = np.zeros((codes.shape[0], 128), dtype=np.uint8)
    qh = np.zeros((codes.shape[0], 64), dtype=np.uint8)
    for r in range(8):
        half, quarter = r // 4, r % 4
        low_at = 64 * half + 32 * (r % 2)
        ql[:, low_at:low_at + 32] |= (codes[:, r] & 0x0F) << (4 * (quarter // 2))
        qh[:, 32 * half:32 * half + 32] |= (codes[:, r] >> 4) << (2 * quarter)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d[:, None].view(np.uint8)], axis=-1)
    return blocks.reshape(num_rows, -1)
