"""The model layer: configs, our Llama-family implementation, weight loading, model files."""

from specdec.models.llama import LlamaForCausalLM
from specdec.models.loader import load_model, load_model_config
from specdec.models.model_config import ModelConfig
from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model, tokenizer_fingerprint

__all__ = [
    "DEFAULT_MODEL",
    "LlamaForCausalLM",
    "ModelConfig",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "resolve_model",
    "tokenizer_fingerprint",
]
