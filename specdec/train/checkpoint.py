"""Resumable training state and the export of trained drafts in their published layouts.

*Training state* (`train_state.pt` in the run directory): the trainable parameters, the
optimizer, the step, the seconds trained so far and the data order, written atomically
every few minutes and at the end; a rerun with the same directory continues from it.

*Export*: the draft's `config.json` and `model.safetensors` in 16-bit, with the checkpoint
names third-party drafts use (q/k/v and gate/up split again, see `published_tensors`), so
the same loaders read them. Tensors the loader takes from the target (embedding, lm_head)
are left out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"

_SPLITS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def published_tensors(module: nn.Module, shard_sizes: Callable[[str], list[int]],
                      exclude: Collection[str] = (), dtype: torch.dtype = torch.bfloat16,
                      rename: Callable[[str], str] = lambda name: name) -> dict[str, torch.Tensor]:
    """`module`'s state dict with fused projections split into their published names.

    Floating tensors are cast to `dtype`; integer / bool buffers (d2t, t2d) keep theirs.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict().items():
        if name in exclude:
            continue
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        fused = next((fused for fused in _SPLITS if f".{fused}." in name), None)
        if fused is None:
            tensors[rename(name)] = tensor.contiguous()
            continue
        for part_name, part in zip(_SPLITS[fused], tensor.split(shard_sizes(fused), dim=0)):
            tensors[rename(name.replace(f".{fused}.", f".{part_name}."))] = part.contiguous()
    return tensors


def write_draft(output_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """Writes config.json and model.safetensors; returns the weight file's size in bytes."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = output_dir / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return weights.stat().st_size


def save_state(run_dir: Path, module: nn.Module, optimizer: torch.optim.Optimizer,
               progress: dict[str, Any]) -> None:
    """Trainable parameters + buffers, optimizer and loop progress, atomically."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    state = {name: tensor for name, tensor in module.state_dict().items()
             if name in trainable or not tensor.is_floating_point()}
    tmp = run_dir / (STATE_FILE + ".tmp")
    torch.save({"module": state, "optimizer": optimizer.state_dict(), "progress": progress}, tmp)
    tmp.replace(run_dir / STATE_FILE)


def load_state(run_dir: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Restores what `save_state` wrote; None when the run directory holds no state."""
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=False)
    missing = module.load_state_dict(saved["module"], strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    optimizer.load_state_dict(saved["optimizer"])
    logger.info("resumed %s at step %d", path, saved["progress"]["step"])
    return saved["progress"]
