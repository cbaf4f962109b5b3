"""The OpenAI-compatible HTTP front of specdec.

Applies the chat template, tokenizes, validates, calls `Verifier.Generate`, detokenizes
incrementally, applies stop strings and answers JSON or SSE. Holds only the tokenizer.
"""

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.verifier_client import VerifierClient

__all__ = ["GatewayConfig", "VerifierClient", "create_app"]
