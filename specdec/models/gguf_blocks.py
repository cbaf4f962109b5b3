"""GGUF's quantized blocks: read into their integer codes and scales, and laid out for
specdec's C++ kernel (`specdec/layers/csrc/gguf_linear_cpu.cpp`), holding exactly the
file's values.

The formats (llama.cpp's `ggml-common.h` block structs; a weight row is a run of blocks
along the input):

| type | inputs a block | bytes | a weight |
|---|---|---|---|
| Q8_0 | 32 | d f16, q int8 [32] | d q |
| Q4_0 | 32 | d f16, 16 bytes of 4-bit u (inputs 0-15 low nibbles, 16-31 high) | d (u - 8) |
| Q4_1 | 32 | d f16, m f16, u as Q4_0 | d u + m |
| Q4_K | 256 | d f16, dmin f16, 12 bytes of 6-bit sc and m (8 groups of 32), 128 bytes of u (*) | d sc_j u - dmin m_j |
| Q6_K | 256 | 128 bytes of low 4 bits, 64 of high 2 bits, sc int8 [16] (groups of 16), d f16 | d sc_j (q - 32) |

(*) each 32 bytes hold a group in the low nibbles and the next group in the high ones.

`unpack` turns a tensor's raw rows into `QuantFields` (codes and per-group header fields);
`pack_rows` lays row-concatenated parts out as the kernel's blocks of 32 output columns
plus the table that says each block's offset, type and columns; `unpack_columns` reads
chosen output columns back out of those blocks (a tied embedding's rows, looked up in the
LM head's blocks). The kernel's decoding of
every type's codes (byte lookups per index, then unpacks within 128-bit lanes) fixes the
order of a pair row's codes: `_POSITION_OF_WORD`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# GGML type ids, as the kernel's table names them.
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
# type -> (inputs a file block covers, bytes of a file block)
_FILE_BLOCKS = {Q8_0: (32, 34), Q4_0: (32, 18), Q4_1: (32, 20), Q4_K: (256, 144), Q6_K: (256, 210)}
BLOCK_COLUMNS = 32


def inputs_per_block(qtype: int) -> int:
    """The inputs one block of `qtype` covers: a row's width must be a multiple of it."""
    return _FILE_BLOCKS[qtype][0]


@dataclass(frozen=True)
class QuantFields:
    """One quantized matrix [rows, inputs] as integers: `codes` [rows, inputs] (the value the
    kernel looks up: q for Q8_0, u for the 4-bit types, the 6-bit q for Q6_K) and `header`,
    the per-unit fields in the kernel's order, each [rows, units, count]."""

    qtype: int
    codes: np.ndarray
    header: tuple[np.ndarray, ...]


def _halves(raw: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte `start` of each block, [rows, blocks, 1]."""
    return np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> their low nibbles then their high nibbles, [..., 2n]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes [..., 12] -> the 6-bit scales and mins of its 8 groups, [..., 8] each.
    Groups 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7: the low
    (scales) and high (mins) nibbles of bytes 8-11, with 2 more bits from the top of bytes
    0-3 (scales) and 4-7 (mins)."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales, mins


def _q6_codes(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Q6_K's 128 low-bit bytes and 64 high-bit bytes [..., n] -> the 256 6-bit codes. Input
    e = 32 r + c: in half h = r // 4 (each half: 64 low bytes, 32 high bytes), its low 4
    bits from low byte 64 h + 32 (r % 2) + c (nibble (r % 4) // 2), its high 2 bits from high
    byte 32 h + c (bits 2 (r % 4))."""
    rows = np.arange(8)
    half, quarter = rows // 4, rows % 4
    columns = np.arange(32)
    low_index = (64 * half + 32 * (rows % 2))[:, None] + columns  # [8, 32]
    low_shift = (4 * (quarter // 2))[:, None]
    high_index = (32 * half)[:, None] + columns
    high_shift = (2 * quarter)[:, None]
    low_bits = (low[..., low_index] >> low_shift) & 0x0F
    high_bits = (high[..., high_index] >> high_shift) & 0x03
    return (low_bits | (high_bits << 4)).reshape(*low.shape[:-1], 256)


def unpack(raw: np.ndarray, qtype: int, in_features: int) -> QuantFields:
    """The fields of a matrix stored as `qtype` blocks: `raw` uint8 [rows, row_bytes]."""
    if qtype not in _FILE_BLOCKS:
        raise ValueError(f"GGML type {qtype} is not one of {', '.join(TYPE_NAMES.values())}")
    inputs, size = _FILE_BLOCKS[qtype]
    if in_features % inputs or raw.shape[-1] != in_features // inputs * size:
        raise ValueError(f"{TYPE_NAMES[qtype]} rows of {in_features} inputs need {in_features // inputs * size} "
                         f"bytes and a multiple of {inputs} inputs; got {raw.shape[-1]} bytes")
    num_rows = raw.shape[0]
    blocks = raw.reshape(num_rows, in_features // inputs, size)
    if qtype == Q8_0:
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        header: tuple[np.ndarray, ...] = (_halves(blocks, 0),)
    elif qtype in (Q4_0, Q4_1):
        start = 2 if qtype == Q4_0 else 4
        codes = _nibbles_split(blocks[..., start:start + 16])
        header = (_halves(blocks, 0),) if qtype == Q4_0 else (_halves(blocks, 0), _halves(blocks, 2))
    elif qtype == Q4_K:
        qs = blocks[..., 16:144].reshape(num_rows, -1, 4, 32)
        codes = _nibbles_split(qs)  # per 32 bytes: a group in the low nibbles, the next in the high
        scales, mins = _k_scales(blocks[..., 4:16])
        header = (_halves(blocks, 0), _halves(blocks, 2), scales, mins)
    else:  # Q6_K
        codes = _q6_codes(blocks[..., 0:128], blocks[..., 128:192])
        header = (_halves(blocks, 208), np.ascontiguousarray(blocks[..., 192:208]).view(np.int8))
    return QuantFields(qtype, codes.reshape(num_rows, in_features), header)


def dequantize_fields(fields: QuantFields) -> np.ndarray:
    """The float32 weights [rows, inputs] the fields stand for (what GGUF's dequantisation
    gives): the kernel's arithmetic, in numpy."""
    num_rows, in_features = fields.codes.shape
    header = [field.astype(np.float32) for field in fields.header]
    codes = fields.codes.astype(np.float32)
    values: np.ndarray
    if fields.qtype in (Q8_0, Q4_0, Q4_1):
        groups = codes.reshape(num_rows, -1, 32) - (8 if fields.qtype == Q4_0 else 0)
        values = header[0] * groups + (header[1] if fields.qtype == Q4_1 else 0)
    elif fields.qtype == Q4_K:
        d, dmin, scales, mins = header
        values = (d * scales)[..., None] * codes.reshape(num_rows, -1, 8, 32) - (dmin * mins)[..., None]
    else:
        d, scales = header
        values = (d * scales)[..., None] * (codes.reshape(num_rows, -1, 16, 16) - 32)
    return values.reshape(num_rows, in_features).astype(np.float32)


def _position_of_word() -> np.ndarray:
    """Where the kernel's lookup takes each code of a pair row from: word W = 2 column +
    parity lands in register W // 32 at lane word W % 32, which the byte unpacks fill from
    index byte 16 L + 8 (W // 32) + i for W % 32 = 8 L + i."""
    words = np.arange(64)
    half, j = words // 32, words % 32
    return 16 * (j // 8) + 8 * half + j % 8


_POSITION_OF_WORD = _position_of_word()
_WORD_AT_POSITION = np.argsort(_POSITION_OF_WORD)
# The inputs a kernel unit (a header and its codes) covers: a file block, or a K-quant's super-block.
_UNIT_INPUTS = {Q8_0: 32, Q4_0: 32, Q4_1: 32, Q4_K: 256, Q6_K: 256}


def _pair_rows(codes: np.ndarray, units: int, unit_inputs: int) -> np.ndarray:
    """Codes [32 b, inputs] -> [b, units, pairs, 64]: a pair row's words 2 column + parity."""
    blocks = codes.shape[0] // BLOCK_COLUMNS
    grouped = codes.reshape(blocks, BLOCK_COLUMNS, units, unit_inputs // 2, 2)
    return grouped.transpose(0, 2, 3, 1, 4).reshape(blocks, units, unit_inputs // 2, 64)


def _code_bytes(fields: QuantFields, padded: np.ndarray, units: int) -> np.ndarray:
    """A block's codes, per unit: [b, units, bytes]."""
    unit_inputs = _UNIT_INPUTS[fields.qtype]
    words = _pair_rows(padded, units, unit_inputs)
    rows: np.ndarray
    index = words[..., _WORD_AT_POSITION]  # by position in the index register
    if fields.qtype == Q8_0:
        rows = index.astype(np.int8).view(np.uint8)
    else:
        index = index.astype(np.uint8)
        low = (index[..., :32] & 0x0F) | ((index[..., 32:] & 0x0F) << 4)
        if fields.qtype == Q6_K:
            high_bits = (index >> 4) & 0x03  # position 16 L + i -> byte i, bits 2 L
            quarters = high_bits.reshape(*index.shape[:-1], 4, 16)
            high = (quarters[..., 0, :] | (quarters[..., 1, :] << 2)
                    | (quarters[..., 2, :] << 4) | (quarters[..., 3, :] << 6))
            rows = np.concatenate([low, high], axis=-1)
        else:
            rows = low
    return rows.reshape(rows.shape[0], units, -1)


def _header_bytes(fields: QuantFields, num_padded: int) -> np.ndarray:
    """A block's unit headers: each field [count][32 columns], in order; [b, units, bytes]."""
    parts = []
    for field in fields.header:
        padded = np.zeros((num_padded, *field.shape[1:]), dtype=field.dtype)
        padded[:field.shape[0]] = field
        blocks = num_padded // BLOCK_COLUMNS
        by_column = padded.reshape(blocks, BLOCK_COLUMNS, field.shape[1], field.shape[2])
        ordered = np.ascontiguousarray(by_column.transpose(0, 2, 3, 1))  # [b, units, count, 32]
        parts.append(ordered.view(np.uint8).reshape(blocks, field.shape[1], -1))
    return np.concatenate(parts, axis=-1)


def pack_rows(parts: list[QuantFields], allocate: Callable[[int], np.ndarray] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's operands for the row-concatenation of `parts` (one input width, each in
    its own type): the blocks, uint8 [total bytes], and the table, int64 [blocks, 4] of
    (byte offset, GGML type, first output column, columns). A part's rows fill blocks of 32
    columns of their own (its last one possibly partial). `allocate(bytes)`: where the
    blocks are written (a uint8 array of that size), else a new array."""
    in_features = parts[0].codes.shape[1]
    chunks, table = [], []
    offset = column = 0
    for fields in parts:
        if fields.codes.shape[1] != in_features:
            raise ValueError("the parts of a fused matrix must share their input width")
        num_rows = fields.codes.shape[0]
        num_padded = -(-num_rows // BLOCK_COLUMNS) * BLOCK_COLUMNS
        units = in_features // _UNIT_INPUTS[fields.qtype]
        padded = np.zeros((num_padded, in_features), dtype=fields.codes.dtype)
        padded[:num_rows] = fields.codes
        per_unit = np.concatenate([_header_bytes(fields, num_padded), _code_bytes(fields, padded, units)], axis=-1)
        blocks = per_unit.reshape(num_padded // BLOCK_COLUMNS, -1)
        chunks.append(blocks.reshape(-1))
        for block in range(blocks.shape[0]):
            columns = min(BLOCK_COLUMNS, num_rows - block * BLOCK_COLUMNS)
            table.append((offset, fields.qtype, column, columns))
            offset += blocks.shape[1]
            column += columns
    out = None if allocate is None else allocate(sum(chunk.size for chunk in chunks))
    return np.concatenate(chunks, out=out), np.asarray(table, dtype=np.int64)


# Each type's header fields, in the kernel's order: (dtype, values a unit).
_HEADER_FIELDS: dict[int, tuple[tuple[type, int], ...]] = {
    Q8_0: ((np.float16, 1),), Q4_0: ((np.float16, 1),), Q4_1: ((np.float16, 1), (np.float16, 1)),
    Q4_K: ((np.float16, 1), (np.float16, 1), (np.uint8, 8), (np.uint8, 8)), Q6_K: ((np.float16, 1), (np.int8, 16))}
# Bytes of a pair row's codes (64 codes): int8, 4 bits, or 4 + 2 bits.
_PAIR_ROW_BYTES = {Q8_0: 64, Q4_0: 32, Q4_1: 32, Q4_K: 32, Q6_K: 48}


@functools.lru_cache(maxsize=16)
def _column_bytes(qtype: int, in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where a block's output column c keeps its values: the byte offsets within the block,
    [32, bytes] (each header field's values, unit by unit, then each unit's pair rows' two
    code bytes, then for Q6_K their two bytes of top bits), and the shifts that take the
    two codes out of their bytes, [32, 2] for the low bits and the top bits."""
    unit_inputs = _UNIT_INPUTS[qtype]
    units, pairs = in_features // unit_inputs, unit_inputs // 2
    header_bytes, unit_bytes = _unit_header_bytes(qtype), _unit_bytes(qtype)
    unit_starts = np.arange(units)[:, None] * unit_bytes
    offsets, low_shifts, high_shifts = [], [], []
    for column in range(BLOCK_COLUMNS):
        parts = []
        start = 0
        for dtype, count in _HEADER_FIELDS[qtype]:
            size = np.dtype(dtype).itemsize
            at = start + (np.arange(count)[:, None] * BLOCK_COLUMNS + column) * size + np.arange(size)
            parts.append((unit_starts + at.reshape(-1)).reshape(-1))
            start += count * BLOCK_COLUMNS * size
        positions = _POSITION_OF_WORD[2 * column + np.arange(2)]  # in the index register
        pair_starts = unit_starts[:, :, None] + header_bytes + np.arange(pairs)[None, :, None] * _PAIR_ROW_BYTES[qtype]
        if qtype == Q8_0:
            parts.append((pair_starts + positions).reshape(-1))
        else:  # position p: the low nibble of byte p, or the high one of byte p - 32
            parts.append((pair_starts + positions % 32).reshape(-1))
            if qtype == Q6_K:  # the top 2 bits: bits 2 (p // 16) of byte 32 + p % 16
                parts.append((pair_starts + 32 + positions % 16).reshape(-1))
        offsets.append(np.concatenate(parts))
        low_shifts.append(4 * (positions // 32))
        high_shifts.append(2 * (positions // 16))
    return (np.stack(offsets), np.stack(low_shifts).astype(np.uint8), np.stack(high_shifts).astype(np.uint8))


def unpack_columns(packed: np.ndarray, blocks: np.ndarray, columns: np.ndarray, qtype: int,
                   in_features: int) -> QuantFields:
    """The fields of output column `columns[i]` (0-31) of block `blocks[i]` of `packed` (uint8
    [bytes]: the blocks of one `qtype` matrix as `pack_rows` lays them out), one row each:
    exactly the rows `pack_rows` was given (`unpack`'s fields of the file's rows). Reads only
    those rows' bytes."""
    offsets, low_shifts, high_shifts = _column_bytes(qtype, in_features)
    units = in_features // _UNIT_INPUTS[qtype]
    num_rows = len(blocks)
    block_bytes = kernel_block_bytes(qtype, in_features)
    columns = np.asarray(columns, dtype=np.int64)
    picked = packed[np.asarray(blocks, dtype=np.int64)[:, None] * block_bytes + offsets[columns]]  # [n, bytes]
    header = []
    start = 0
    for dtype, count in _HEADER_FIELDS[qtype]:
        size = units * count * np.dtype(dtype).itemsize
        field: np.ndarray = np.ascontiguousarray(picked[:, start:start + size]).view(dtype)
        header.append(field.reshape(num_rows, units, count))
        start += size
    code_count = in_features  # one byte a code, then (Q6_K) one more for its top bits
    shape = (num_rows, in_features // 2, 2)
    code_bytes = picked[:, start:start + code_count].reshape(shape)
    codes: np.ndarray
    if qtype == Q8_0:
        codes = code_bytes.view(np.int8)
    else:
        codes = (code_bytes >> low_shifts[columns][:, None, :]) & 0x0F
        if qtype == Q6_K:
            top = picked[:, start + code_count:].reshape(shape)
            codes = codes | (((top >> high_shifts[columns][:, None, :]) & 0x03) << 4)
    return QuantFields(qtype, codes.reshape(num_rows, in_features), tuple(header))


def kernel_block_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one block of 32 output columns in the kernel's layout."""
    return in_features // _UNIT_INPUTS[qtype] * _unit_bytes(qtype)


def _unit_header_bytes(qtype: int) -> int:
    """Bytes of a unit's header fields for a block's 32 columns, in the kernel's layout."""
    return sum(count * BLOCK_COLUMNS * np.dtype(dtype).itemsize for dtype, count in _HEADER_FIELDS[qtype])


def _unit_bytes(qtype: int) -> int:
    """Bytes of one unit (its header, then its pair rows of codes) for 32 columns."""
    return _unit_header_bytes(qtype) + _UNIT_INPUTS[qtype] // 2 * _PAIR_ROW_BYTES[qtype]
