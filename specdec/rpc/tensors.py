"""Tensors on the wire: torch tensors to and from the proto `Tensor` message.

Wire format (protos/specdec/v1/specdec.proto): `data` holds the elements in row-major
order as raw little-endian bytes, `dtype` is the torch dtype name without its prefix
("float32", "bfloat16", ...), `shape` the sizes. numpy has no bfloat16, so bfloat16
travels through an int16 view of the same bits; every other dtype through numpy's
explicitly little-endian type, so a big-endian host still writes and reads the wire order.

`decode_tensor` validates everything a peer controls (dtype name, shape, byte length,
size) before allocating and raises `InvalidRequestError` naming the field; it never
returns a tensor that aliases the message's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np
import torch

from specdec.errors import InvalidRequestError
from specdec.v1 import specdec_pb2

# Wire dtype name -> (torch dtype, little-endian numpy dtype of the same width).
_WIRE_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<i2")),  # same bits, read through int16
    "float64": (torch.float64, np.dtype("<f8")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
WIRE_DTYPE_NAMES = tuple(_WIRE_DTYPES)
FLOAT_DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Above gRPC's message limits on both ends; a peer claiming more is refused before allocating.
MAX_TENSOR_BYTES = 1 << 30
_MAX_DIMS = 8


def wire_dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; ValueError for dtypes the wire cannot carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in _WIRE_DTYPES:
        raise ValueError(f"dtype {dtype} cannot travel as a Tensor; allowed: {', '.join(WIRE_DTYPE_NAMES)}")
    return name


def encode_tensor(tensor: torch.Tensor, message: specdec_pb2.Tensor | None = None,
                  *, max_bytes: int = MAX_TENSOR_BYTES) -> specdec_pb2.Tensor:
    """Writes `tensor` into `message` (a new one when None) and returns the message.

    ValueError when the dtype has no wire name or the tensor is larger than `max_bytes`:
    both are bugs of the sender, not of its peer.
    """
    name = wire_dtype_name(tensor.dtype)
    torch_dtype, wire_dtype = _WIRE_DTYPES[name]
    num_bytes = tensor.numel() * tensor.element_size()
    if num_bytes > max_bytes:
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} ({num_bytes} bytes) exceeds the "
                         f"{max_bytes}-byte limit")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if torch_dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    array = flat.numpy()
    if array.dtype != wire_dtype:  # only on big-endian hosts: swap to wire order
        array = array.astype(wire_dtype)
    if message is None:
        message = specdec_pb2.Tensor()
    message.data = array.tobytes()
    message.dtype = name
    del message.shape[:]
    message.shape.extend(tensor.shape)
    return message


def decode_tensor(message: specdec_pb2.Tensor, *, field: str,
                  dtypes: Collection[str] | None = None,
                  shape: Sequence[int | None] | None = None,
                  max_bytes: int = MAX_TENSOR_BYTES) -> torch.Tensor:
    """The tensor a message carries, on the CPU, owning its memory.

    `dtypes` limits the accepted dtype names (default: any wire dtype); `shape` gives the
    expected sizes, None for a size that may be anything. Anything else raises
    `InvalidRequestError` naming `field`.
    """
    allowed = WIRE_DTYPE_NAMES if dtypes is None else tuple(dtypes)
    if message.dtype not in allowed or message.dtype not in _WIRE_DTYPES:
        raise InvalidRequestError(
            f"{field}: dtype {message.dtype!r} is not supported here; allowed: {', '.join(allowed)}",
            param=field)
    torch_dtype, wire_dtype = _WIRE_DTYPES[message.dtype]
    sizes = [int(size) for size in message.shape]
    if len(sizes) > _MAX_DIMS:
        raise InvalidRequestError(f"{field}: {len(sizes)} dimensions, at most {_MAX_DIMS}", param=field)
    if shape is not None:
        expected = list(shape)
        if len(sizes) != len(expected) or any(
                want is not None and got != want for got, want in zip(sizes, expected)):
            described = "[" + ", ".join("*" if want is None else str(want) for want in expected) + "]"
            raise InvalidRequestError(f"{field}: shape {sizes}, expected {described}", param=field)
    num_bytes = math.prod(sizes) * wire_dtype.itemsize  # Python ints: no overflow
    if num_bytes > max_bytes:
        raise InvalidRequestError(f"{field}: shape {sizes} needs {num_bytes} bytes, more than the "
                                  f"{max_bytes}-byte limit", param=field)
    if len(message.data) != num_bytes:
        raise InvalidRequestError(
            f"{field}: {len(message.data)} data bytes, but shape {sizes} of {message.dtype} needs "
            f"{num_bytes}", param=field)
    # astype copies (swapping bytes only on big-endian hosts), so the result owns its memory.
    array = np.frombuffer(message.data, dtype=wire_dtype).astype(wire_dtype.newbyteorder("="))
    tensor = torch.from_numpy(array)
    if torch_dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor.view(sizes)
