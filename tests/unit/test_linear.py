"""specdec.models.linear: the few-row fp32 CPU path matches F.linear up to fp32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.models.linear import SMALL_M, Linear, linear


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, SMALL_M, SMALL_M + 1, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(num_rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(num_rows, 40, generator=generator)
    out = linear(x, weight, bias)
    assert out.shape == (num_rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_other_inputs_fall_back() -> None:
    weight = torch.randn(16, 8)
    x3 = torch.randn(2, 3, 8)
    assert torch.equal(linear(x3, weight), F.linear(x3, weight))
    xb, wb = torch.randn(1, 8, dtype=torch.bfloat16), weight.to(torch.bfloat16)
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))


def test_module_keeps_nn_linear_state() -> None:
    layer = Linear(8, 16, bias=True)
    assert isinstance(layer, torch.nn.Linear)
    assert set(layer.state_dict()) == {"weight", "bias"}
    x = torch.randn(1, 8)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
