"""specdec.models.packed_linear: repacked kernels compute what F.linear computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import ConfigError
from specdec.layers import cpu_extension
from specdec.layers.cpu_extension import linear_supports
from specdec.models.loader import load_model
from specdec.models.packed_linear import (
    PackedLinear,
    choose_kernel,
    mkldnn_supported,
    pack_linears,
)
from tests.support.tiny_models import make_tiny_llama

needs_bf16_mkldnn = pytest.mark.skipif(not mkldnn_supported(torch.bfloat16),
                                       reason="this CPU has no oneDNN bf16 path")


def _layer(dtype: torch.dtype, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(48, 80, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_mkldnn)])
@pytest.mark.parametrize("num_rows", [1, 4, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_mkldnn_matches_f_linear(dtype: torch.dtype, num_rows: int, bias: bool) -> None:
    layer = _layer(dtype, bias)
    x = torch.randn(num_rows, 48).to(dtype)
    with torch.inference_mode():
        expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        out = PackedLinear(layer, "mkldnn", keep_weight=False)(x)
    assert out.dtype == dtype and out.shape == (num_rows, 80)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_equals_the_dequantised_weight(dtype: torch.dtype) -> None:
    layer = _layer(dtype, bias=True)
    packed = PackedLinear(layer, "int8", keep_weight=False)
    assert packed.weight is None
    # Per output channel, symmetric: the scale max|w| / 127 in the model's dtype, the steps
    # rounded to the nearest.
    scales = (layer.weight.float().abs().amax(dim=1) / 127).to(dtype).float()
    steps = torch.round(layer.weight.float() / scales[:, None]).to(torch.int8)
    assert torch.equal(packed.scales.float(), scales)
    # bf16 on specdec's kernel where it is built (its blocks), else torch's (the steps).
    assert packed.own_int8 == linear_supports(dtype, int8_weights=True)
    if packed.own_int8:
        assert torch.equal(packed.packed, torch.ops.specdec_cpu.pack_weight_int8(steps))
    else:
        assert torch.equal(packed.packed, steps)
    dequantised = steps.float() * scales[:, None]  # [80, 48]
    # Quantisation error is at most half a step per weight.
    assert ((layer.weight.float() - dequantised).abs() / scales[:, None]).max() <= 0.5 + 1e-3
    x = torch.randn(5, 48).to(dtype)
    with torch.inference_mode():
        out = packed(x)
    expected = x.float() @ dequantised.T + layer.bias.float()
    tolerance = 1e-4 if dtype == torch.float32 else 8e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_leading_dims_are_kept() -> None:
    layer = _layer(torch.float32, bias=False)
    x = torch.randn(2, 3, 48)
    with torch.inference_mode():
        out = PackedLinear(layer, "mkldnn", keep_weight=False)(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_pack_linears_keeps_a_tied_head_and_the_logits(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    reference = load_model(model_dir, torch.float32, torch.device("cpu"))
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    num_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert pack_linears(model, "mkldnn") == num_linears
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # The embedding still owns the tied weight; the head reads a packed copy of it.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].mlp.down_proj.weight is None
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden), reference.compute_logits(hidden),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("device", "dtype", "quantization", "expected"), [
    ("cpu", torch.float32, None, "cpu" if linear_supports(torch.float32) else None),
    ("cpu", torch.bfloat16, None, "cpu" if linear_supports(torch.bfloat16)
     else "mkldnn" if mkldnn_supported(torch.bfloat16) else None),
    ("cpu", torch.float16, None, "mkldnn" if mkldnn_supported(torch.float16) else None),
    ("cpu", torch.float32, "int8", "int8"),
    ("cpu", torch.bfloat16, "int8", "int8"),
    ("cuda", torch.bfloat16, None, None),
])
def test_choose_kernel(device: str, dtype: torch.dtype, quantization: str | None,
                       expected: str | None) -> None:
    assert choose_kernel(torch.device(device), dtype, quantization) == expected


def test_without_the_extension_bf16_uses_onednn_and_fp32_the_plain_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_extension, "load_extension", lambda: None)
    assert choose_kernel(torch.device("cpu"), torch.float32, None) is None
    expected = "mkldnn" if mkldnn_supported(torch.bfloat16) else None
    assert choose_kernel(torch.device("cpu"), torch.bfloat16, None) == expected


@pytest.mark.parametrize(("device", "quantization", "words"), [
    ("cpu", "fp4", "allowed: int8"),
    ("cuda", "int8", "cpu only"),
])
def test_bad_quantization_is_refused(device: str, quantization: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        choose_kernel(torch.device(device), torch.float32, quantization)
    assert info.value.param == "quantization"
