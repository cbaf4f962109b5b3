"""specdec.rpc.tensors: torch tensors to and from the proto Tensor, and what decode refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.errors import InvalidRequestError
from specdec.rpc.tensors import decode_tensor, encode_tensor
from specdec.v1 import specdec_pb2

FIELD = "sequences.hidden_states"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    values = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 50
    tensor = values > 0 if dtype == torch.bool else values.to(dtype)
    message = encode_tensor(tensor)
    assert message.dtype == str(dtype).removeprefix("torch.")
    assert list(message.shape) == [3, 5]
    assert len(message.data) == tensor.numel() * tensor.element_size()
    decoded = decode_tensor(message, field=FIELD)
    assert decoded.dtype == dtype and decoded.shape == (3, 5)
    assert torch.equal(decoded, tensor)


def test_wire_bytes_are_little_endian_and_bfloat16_keeps_its_bits() -> None:
    message = encode_tensor(torch.tensor([1.0, -2.0], dtype=torch.float32))
    assert message.data == np.array([1.0, -2.0], dtype="<f4").tobytes()
    bf16 = torch.tensor([1.0, 3.140625], dtype=torch.bfloat16)
    message = encode_tensor(bf16)
    assert message.data == bf16.view(torch.int16).numpy().astype("<i2").tobytes()


def test_encode_fills_a_given_message_and_handles_views_and_empty() -> None:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    view = base[:, 1::2].t()  # non-contiguous
    message = specdec_pb2.Tensor()
    assert encode_tensor(view, message) is message
    assert torch.equal(decode_tensor(message, field=FIELD), view)
    empty = encode_tensor(torch.empty(0, 7))
    assert decode_tensor(empty, field=FIELD, shape=(0, 7)).shape == (0, 7)


def test_decoded_tensor_owns_its_memory() -> None:
    message = encode_tensor(torch.ones(2, 2))
    decoded = decode_tensor(message, field=FIELD)
    decoded += 1  # writable, and the message is untouched
    assert torch.equal(decode_tensor(message, field=FIELD), torch.ones(2, 2))


@pytest.mark.parametrize("mutate, needle", [
    (lambda m: setattr(m, "dtype", "complex64"), "dtype 'complex64'"),
    (lambda m: setattr(m, "dtype", ""), "dtype ''"),
    (lambda m: setattr(m, "data", m.data[:-1]), "data bytes"),
    (lambda m: setattr(m, "data", m.data + b"\x00" * 4), "data bytes"),
    (lambda m: m.shape.append(1), "shape [2, 3, 1]"),
    (lambda m: m.shape.__setitem__(1, 4), "shape [2, 4]"),
])
def test_malformed_messages_name_the_field(mutate, needle: str) -> None:
    message = encode_tensor(torch.zeros(2, 3))
    mutate(message)
    with pytest.raises(InvalidRequestError) as info:
        decode_tensor(message, field=FIELD, shape=(2, None))
    assert info.value.param == FIELD
    assert FIELD in info.value.message and needle in info.value.message


def test_expected_shape_and_dtypes_are_enforced() -> None:
    message = encode_tensor(torch.zeros(2, 3, dtype=torch.float16))
    assert decode_tensor(message, field=FIELD, shape=(None, 3)).shape == (2, 3)
    with pytest.raises(InvalidRequestError, match=r"shape \[2, 3\], expected \[\*, 4\]"):
        decode_tensor(message, field=FIELD, shape=(None, 4))
    with pytest.raises(InvalidRequestError, match="allowed: float32, bfloat16"):
        decode_tensor(message, field=FIELD, dtypes=("float32", "bfloat16"))


def test_size_limit_is_checked_before_allocating() -> None:
    # A huge claimed shape with no data: refused on the size, not by allocating it.
    message = specdec_pb2.Tensor(dtype="float32", shape=[1 << 20, 1 << 20], data=b"")
    with pytest.raises(InvalidRequestError, match="limit"):
        decode_tensor(message, field=FIELD)
    with pytest.raises(InvalidRequestError, match="limit"):
        decode_tensor(encode_tensor(torch.zeros(64)), field=FIELD, max_bytes=100)
    with pytest.raises(ValueError, match="limit"):
        encode_tensor(torch.zeros(64), max_bytes=100)


def test_encode_refuses_dtypes_without_a_wire_name() -> None:
    with pytest.raises(ValueError, match="cannot travel"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))
