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


def make_byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (the kind GGUF's `gpt2` tokenizer stores): the special tokens, one
    token per byte and one merge ("ab"; a file holds a merge list only when it is not empty)."""
    from tokenizers import decoders

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for character in pre_tokenizers.ByteLevel.alphabet():
        vocab[character] = len(vocab)
    vocab["ab"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_gguf_ready_llama(path: Path, *, hidden_size: int = 256, intermediate_size: int = 512,
                          num_layers: int = 2, seed: int = 0, tie_word_embeddings: bool = True,
                          layer_scale: float = 0.6) -> Path:
    """A random Llama that can be written as GGUF at every precision: widths in whole K-quant
    super-blocks (256), a byte-level BPE tokenizer (260 tokens). The layers' matrices are
    `layer_scale` times the embedding's size: with a tied LM head the greedy text then often
    repeats a token or a few (what ngram drafts from) and still changes course."""
    torch.manual_seed(seed)
    tokenizer = make_byte_level_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=EOS_TOKEN_ID,
                         tie_word_embeddings=tie_word_embeddings)
    model = LlamaForCausalLM(config)
    std = 0.3 * (32 / hidden_size) ** 0.5
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, std if "embed" in name or "lm_head" in name else layer_scale * std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
