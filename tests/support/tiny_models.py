"""Tiny random checkpoints written to disk in Hugging Face's layout, with a tokenizer.

They go through the same resolver and loader as real models. The tokenizer is a word
level one over "w0 w1 ..." so any token id sequence round-trips through text.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} {{ message['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}")
EOS_TOKEN_ID = 2


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for index in range(len(SPECIAL_TOKENS), vocab_size):
        vocab[f"w{index}"] = index
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_llama(path: Path, *, vocab_size: int = 96, hidden_size: int = 32,
                    num_layers: int = 2, seed: int = 0, max_positions: int = 512,
                    tie_word_embeddings: bool = False) -> Path:
    """A random Llama (GQA) with its tokenizer, saved to `path`."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64,
                         num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=EOS_TOKEN_ID,
                         tie_word_embeddings=tie_word_embeddings)
    model = LlamaForCausalLM(config)
    # Larger weights than the default init make the random model's greedy text varied
    # instead of one repeated token.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(path)
    make_tokenizer(vocab_size).save_pretrained(path)
    return path
