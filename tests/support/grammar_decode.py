"""A tiny random Llama over the default model's vocabulary, decoded under a grammar.

Shared by the grammar tests of tests/stack (backend, tool calls, faults, limits): the
model's logits are wider than the tokenizer (padding ids) and favour the padding ids, so
only the grammar's masks make its output valid text.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verifier_svc.grammar import GrammarBackend, apply_masks

TOKENIZER_VOCAB = 49152  # SmolLM2's
PADDED_VOCAB = TOKENIZER_VOCAB + 64


def make_padded_tiny_model(eos_token_id: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=PADDED_VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=eos_token_id)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.5)
        # Padding ids get the largest logits: an unmasked decode would pick them.
        model.lm_head.weight[TOKENIZER_VOCAB:] = 5.0
    return model


def masked_decode(backend: GrammarBackend, model: LlamaForCausalLM, tokenizer, kind: str,
                  value: str, max_tokens: int = 160, sample_seed: int | None = None,
                  bias: dict[int, float] | None = None) -> str:
    """Greedy (or seeded sampled) decode under the grammar; the text before EOS.

    `bias` is added to the raw logits (before the mask), e.g. to make a random model close an
    unbounded array sooner."""
    state = backend.new_state(backend.compile(kind, value))
    prompt = [1, 2, 3]
    ids: list[int] = []
    generator = torch.Generator().manual_seed(sample_seed) if sample_seed is not None else None
    past = None
    step_input = prompt
    for _ in range(max_tokens):
        # Once the grammar is complete the mask allows EOS alone, which ends the loop.
        with torch.no_grad():
            output = model(torch.tensor([step_input]), cache=past, use_cache=True)
        past = output.cache
        logits = output.logits[0, -1:].clone()
        for token_id, extra in (bias or {}).items():
            logits[0, token_id] += extra
        apply_masks(logits, state.fill_masks([]))
        if generator is None:
            token = int(logits.argmax(-1))
        else:
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert state.accept(token), token
        if token in backend.eos_token_ids:
            break
        ids.append(token)
        step_input = [token]
    assert state.is_accepting(), f"no complete output in {max_tokens} tokens"
    return tokenizer.decode(ids)


def late_limit_grammar(num_digits: int) -> str:
    """A Lark grammar that compiles, then goes past llguidance's lexer limits at its token
    `num_digits + 1`: `num_digits` digits (one token each in SmolLM2's vocabulary), a space,
    then a regex whose lexer blows up as it is entered."""
    return f'start: DIGITS " " BIG\nDIGITS: /[0-9]{{{num_digits}}}/\nBIG: /(a{{1000}}){{1000}}/\n'
