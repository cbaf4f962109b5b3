"""A Llama's tensor names in llama.cpp's GGUF files and in Hugging Face checkpoints, and
llama.cpp's row order of q and k: what the GGUF writer, the GGUF tensor reader and the model
served on a file's blocks all map between.
"""

from __future__ import annotations

import numpy as np

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face Llama tensor name."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.<i>.<module...>.<weight|bias>
    if parts[:2] != ["model", "layers"]:
        raise ValueError(f"no GGUF name for {hf_name!r}")
    module, leaf = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{_LAYER_NAMES[module]}.{leaf}"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama name of a llama.cpp tensor name, or None for one with no HF
    counterpart (`rope_freqs.weight`)."""
    top = {gguf: hf for hf, gguf in _TOP_NAMES.items()}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")  # blk.<i>.<role>.<weight|bias>
    modules = {gguf: hf for hf, gguf in _LAYER_NAMES.items()}
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in modules:
        return None
    return f"model.layers.{parts[1]}.{modules[parts[2]]}.{parts[3]}"


def rope_permutation(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order of llama.cpp's q/k: its row h d + 2 i + j (d rows a head) is HF's row
    h d + j d / 2 + i; so llama.cpp's rows are `hf[rope_permutation(...)]`."""
    half = num_rows // num_heads // 2
    head, i, j = np.meshgrid(np.arange(num_heads), np.arange(half), np.arange(2), indexing="ij")
    return (head * 2 * half + j * half + i).reshape(-1)
