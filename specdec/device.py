"""Device and dtype selection, and the memory a device offers."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda", "npu")
DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


# The NPU caching allocator's settings; read once, when torch_npu initialises the device.
NPU_ALLOC_CONF_ENV = "PYTORCH_NPU_ALLOC_CONF"
# As vllm-ascend does: expandable segments cut the fragmentation a KV pool plus changing
# activation sizes cause. Applied only when the variable is unset.
DEFAULT_NPU_ALLOC_CONF = "expandable_segments:True"


def configure_npu_allocator() -> str:
    """Sets PYTORCH_NPU_ALLOC_CONF to the default unless the user set it; returns its value.

    Must run before torch_npu is imported (the allocator reads it then).
    """
    value = os.environ.get(NPU_ALLOC_CONF_ENV)
    if value is None:
        os.environ[NPU_ALLOC_CONF_ENV] = value = DEFAULT_NPU_ALLOC_CONF
        logger.info("%s=%s (specdec's default; set the variable to override)",
                    NPU_ALLOC_CONF_ENV, value)
    else:
        logger.info("%s=%s (from the environment)", NPU_ALLOC_CONF_ENV, value)
    return value


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    configure_npu_allocator()
    import torch_npu  # noqa: F401  (registers torch.npu)
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def resolve_device(name: str) -> torch.device:
    """`auto` picks npu (torch_npu importable and a device present), then cuda, then cpu."""
    if name not in DEVICES:
        raise ConfigError(f"--device {name!r} is not supported; allowed values: "
                          f"{', '.join(DEVICES)}", param="device")
    if name == "auto":
        if npu_available():
            return torch.device("npu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if name == "npu" and not npu_available():
        raise ConfigError("--device npu: torch_npu is not installed or no NPU is present",
                          param="device")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is present", param="device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16, as vLLM picks for a float32 or bfloat16 checkpoint, except on a
    CPU without oneDNN's bf16 kernels, where float32 is the faster choice.

    On the CPU, bf16 with oneDNN-packed weights verifies 1 + k tokens at the cost of one
    (fp32: ~1.7x for 5 tokens), which is what makes speculation pay; fp32 gives bit-exact
    speculation, bf16 may flip a greedy near-tie (see the README's performance section).
    """
    if name == "auto":
        if device.type == "cpu":
            from specdec.models.packed_linear import mkldnn_supported
            return torch.bfloat16 if mkldnn_supported(torch.bfloat16) else torch.float32
        return torch.bfloat16
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is not supported; allowed values: auto, "
                          "float32, bfloat16, float16", param="dtype")
    return DTYPES[name]


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of the device: the accelerator's, or the machine's RAM on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "npu":
        return torch.npu.get_device_properties(device).total_memory  # type: ignore[attr-defined]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
