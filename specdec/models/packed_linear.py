"""Inference-only linear layers whose weights are repacked once for a faster CPU kernel.

A decode or verify forward on a CPU is bound by how fast the matmuls read the weights, and
that depends on the kernel more than on the dtype (measured on the default model's shapes,
2 cores: torch's stock bf16 `F.linear` streams the LM head at ~7 GB/s, the same weight
in oneDNN's blocked layout reads several times faster for 1..8 rows). So after loading,
`pack_linears` swaps every `nn.Linear` of a model for a `PackedLinear` running one of:

- `cpu`: specdec's own kernel (`torch.ops.specdec_cpu.linear`, built by
  `specdec.layers.cpu_extension`; AVX-512 machines, fp32 and, with AVX512-BF16, bf16), on the
  weight packed once in blocks of 32 output columns (`torch.ops.specdec_cpu.pack_weight`).
  It reads the weights faster than oneDNN or MKL for a few rows and multiplies faster for
  the 8-16 rows of a batched step (see `csrc/linear_cpu.cpp`). Row-invariant: a token's
  outputs do not depend on how many rows share the call.
- `mkldnn`: the weight reordered once into oneDNN's layout
  (`torch.ops.mkldnn._reorder_linear_weight`), multiplied by `_linear_pointwise`: what
  inductor's `freezing` emits for a compiled CPU model, without compiling. Exact in the
  sense that it computes the same products as `F.linear` (up to summation order).
- `int8`: weight-only int8 (per output channel, symmetric, scale = max|w| / 127): half the
  bytes of bf16 to read. Lossy with respect to the checkpoint (the model changes a little);
  speculation stays lossless with respect to the quantised model. bf16 and fp32 models run
  it on specdec's kernel (`pack_weight_int8`: the same blocks, the int8 weights turned to
  bf16, or fp32, in registers, the scale applied to the sums; row-invariant like `cpu`)
  where the machine has AVX512-VBMI (and AVX512-BF16 for bf16 rows); otherwise
  `torch.ops.aten._weight_int8pack_mm`, which dequantises on the fly but reads slower than
  the bf16 `cpu` kernel (see the README's performance section).

A weight shared with another parameter (a tied LM head and embedding) stays referenced
by the module, so a tied head costs its packed copy besides; any other original weight is
dropped after packing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.layers.cpu_extension import linear_supports

logger = logging.getLogger(__name__)

KERNELS = ("cpu", "mkldnn", "int8")
# Row count oneDNN is told to expect when it picks the packed layout: decode and verify
# steps are a handful of rows.
PACK_BATCH_HINT = 4


def mkldnn_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build run oneDNN linears in `dtype`."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` on a weight packed for `kernel` (see the module docstring)."""

    def __init__(self, linear: nn.Linear, kernel: str, keep_weight: bool) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; allowed: {', '.join(KERNELS)}")
        weight = linear.weight.detach()  # [out_features, in_features]
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.kernel = kernel
        self.bias = linear.bias
        # Kept only when something else (a tied embedding) owns the same storage.
        self.weight = linear.weight if keep_weight else None
        self.own_int8 = False  # int8 on specdec's kernel (set below)
        if kernel == "cpu":
            if not linear_supports(weight.dtype):
                raise ValueError(f"specdec's cpu linear kernel has no {weight.dtype} path on this machine")
            # A buffer, not a plain attribute: torch.compile then keeps its shape static (as
            # a plain tensor's, the blocks' sizes became symbols inductor lost when freezing).
            self.register_buffer("packed", torch.ops.specdec_cpu.pack_weight(weight), persistent=False)
        elif kernel == "mkldnn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        else:
            weight32 = weight.float()
            # Rounded to the model dtype first, so the int8 values are steps of the very
            # scale the kernel multiplies by.
            scales = (weight32.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(weight.dtype)
            steps = weight32 / scales.float()[:, None]  # [out_features, in_features]
            quantized = torch.round(steps).clamp(-127, 127).to(torch.int8)
            # specdec's kernel where it runs these rows: then `packed` is its uint8 blocks and
            # the scales are float32 (the same values).
            self.own_int8 = linear_supports(weight.dtype, int8_weights=True)
            if self.own_int8:
                self.register_buffer("packed", torch.ops.specdec_cpu.pack_weight_int8(quantized), persistent=False)
                self.register_buffer("scales", scales.float(), persistent=False)
            else:
                self.packed, self.scales = quantized, scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "cpu":
            out = torch.ops.specdec_cpu.linear(rows, self.packed, self.bias, self.out_features)
        elif self.kernel == "mkldnn":
            num_rows = rows.shape[0]
            if num_rows == 1:
                # oneDNN's one-row kernel sums in another order than its multi-row one: a
                # zero row makes a decode row bit-identical to the same row in a verify window.
                rows = torch.cat((rows, rows.new_zeros(1, self.in_features)))
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
            out = out[:num_rows]
        elif self.own_int8:
            out = torch.ops.specdec_cpu.linear(rows, self.packed, self.bias, self.out_features, self.scales)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.packed, self.scales.to(rows.dtype))
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}")


def pack_linears(model: nn.Module, kernel: str, only: tuple[str, ...] | None = None) -> int:
    """Replaces every `nn.Linear` in `model` (or those named in `only`, e.g. `("lm_head",)`)
    by a `PackedLinear`; returns how many.

    For inference only: call after the weights are loaded (and sharded), on a CPU model.
    """
    linears = [(parent, name, child) for parent_name, parent in model.named_modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)
               and (only is None or f"{parent_name}.{name}".lstrip(".") in only)]
    linear_weights = {id(child.weight) for _, _, child in linears}
    shared = {id(param) for name, param in model.named_parameters(remove_duplicate=False)
              if id(param) in linear_weights and not _is_linear_weight(model, name)}
    with torch.inference_mode(False), torch.no_grad():
        for parent, name, child in linears:
            setattr(parent, name, PackedLinear(child, kernel, keep_weight=id(child.weight) in shared))
    logger.info("packed %d linear layers for the %s kernel", len(linears), kernel)
    return len(linears)


def _is_linear_weight(model: nn.Module, param_name: str) -> bool:
    module_name, _, leaf = param_name.rpartition(".")
    return leaf == "weight" and isinstance(model.get_submodule(module_name), nn.Linear)



def choose_kernel(device: torch.device, dtype: torch.dtype, quantization: str | None) -> str | None:
    """The packed kernel for a model on `device` in `dtype`; None keeps `nn.Linear` as is.

    Measured on this project's CPU machine (see the README's performance section): specdec's
    own kernel where it is built for the dtype; else bf16 via oneDNN beats stock bf16
    `F.linear`, and fp32 keeps `specdec.models.linear`'s few-row path.
    """
    if quantization is not None and quantization != "gguf":  # gguf: the file's own blocks (gguf_model)
        if quantization != "int8":
            raise ConfigError(f"--quantization {quantization!r} is not supported; allowed: int8, gguf",
                              param="quantization")
        if device.type != "cpu":
            raise ConfigError("--quantization int8 runs on the cpu only (its weight-only int8 "
                              f"kernels are CPU kernels); got --device {device.type}", param="quantization")
        return "int8"
    if device.type != "cpu":
        return None
    if linear_supports(dtype):
        return "cpu"
    if dtype in (torch.bfloat16, torch.float16) and mkldnn_supported(dtype):
        return "mkldnn"
    return None


def pack_for_device(model: nn.Module, device: torch.device, dtype: torch.dtype,
                    quantization: str | None = None) -> str | None:
    """Packs `model`'s linears for the kernel `choose_kernel` picks; returns it (None: none)."""
    kernel = choose_kernel(device, dtype, quantization)
    if kernel is not None:
        pack_linears(model, kernel)
    return kernel
