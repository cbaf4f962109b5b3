"""Greedy verification at an exact tie: a draft token is accepted only where it is the token
plain decoding picks, and both take the first maximal index (`argmax_rows`, as torch.argmax).

The target here ties by construction: its LM head gives tokens 10 and 20 the same row w and
every other token -w, so at every position either 10 and 20 share the top logit (h . w > 0)
or all the others do, bit for bit in fp32 and bf16 (the same products summed in the same
order, or their negations). Plain decoding then emits 10 or 0 only; the prompt makes the
n-gram drafter propose the other tied token (20 after 10, 1 after 0) at every step, so a
verifier that accepted a draft token tied with the argmax would emit 20 or 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specdec.engine.sampling_params import SamplingParams
from tests.support.engine_harness import generate, ngram_engine
from tests.support.tiny_models import make_tiny_llama

FIRST, SECOND = 10, 20  # tied at the top where h . w > 0; else 0 and 1 lead the tied rest
PROMPT = [FIRST, SECOND, 0, 1, 5, FIRST, SECOND, 0, 1, 6, FIRST]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_llama(tmp_path_factory.mktemp("tied"))
    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        row = model.lm_head.weight[FIRST].clone()
        model.lm_head.weight.copy_(-row.expand_as(model.lm_head.weight))
        model.lm_head.weight[FIRST] = row
        model.lm_head.weight[SECOND] = row
    model.save_pretrained(path)
    return path


# The engine's one-argmax shortcut (plain greedy) and `verify` (a greedy request whose
# logit_bias, of 0, sends it through the logits processing).
PARAMS = {"greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
          "processed": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                      logit_bias={50: 0.0})}


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_verification_breaks_an_exact_tie_as_plain_decoding_does(tied_model: Path, dtype: str,
                                                                      params: str) -> None:
    async with ngram_engine(tied_model, "cpu", dtype=dtype) as engine:
        plain = await generate(engine, PROMPT, PARAMS[params])
    async with ngram_engine(tied_model, "cpu", k=3, dtype=dtype) as engine:
        speculated = await generate(engine, PROMPT, PARAMS[params])
        drafted, accepted = engine.spec.num_draft_tokens, engine.spec.num_accepted_tokens
    assert set(plain) <= {FIRST, 0}, f"the first of the tied tokens wins: {plain}"
    assert drafted > accepted, "the drafter proposed tied tokens that had to be rejected"
    assert speculated == plain
