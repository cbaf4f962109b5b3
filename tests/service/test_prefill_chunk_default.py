"""The largest prefill chunk beside running decodes defaults by device: 128 tokens on a CPU
(where a chunk's compute, not the weight read, sets the step's time), 512 on an
accelerator; a value given on the command line is kept (issue 44, item 9)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.config import (
    ACCELERATOR_LONG_PREFILL_TOKEN_THRESHOLD,
    CPU_LONG_PREFILL_TOKEN_THRESHOLD,
    default_long_prefill_token_threshold,
)
from specdec.config_flags import build_config
from tests.support.engine_harness import served_engine
from tests.support.tiny_models import make_tiny_llama
from verifier_svc import __main__ as verifier_main
from verifier_svc.builder import VerifierConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-prefill-chunk"))


def test_the_default_is_the_devices() -> None:
    assert default_long_prefill_token_threshold("cpu") == CPU_LONG_PREFILL_TOKEN_THRESHOLD == 128
    for device_type in ("cuda", "npu"):
        assert default_long_prefill_token_threshold(device_type) == ACCELERATOR_LONG_PREFILL_TOKEN_THRESHOLD
    parser = verifier_main.build_parser()
    assert build_config(VerifierConfig, parser.parse_args([])).engine.long_prefill_token_threshold is None
    given = parser.parse_args(["--long-prefill-token-threshold", "0"])
    assert build_config(VerifierConfig, given).engine.long_prefill_token_threshold == 0


@pytest.mark.parametrize(("given", "resolved"), [(None, CPU_LONG_PREFILL_TOKEN_THRESHOLD), (0, 0), (512, 512)])
async def test_the_builder_fills_in_the_cpus_default(tiny_model: Path, given: int | None,
                                                      resolved: int) -> None:
    async with served_engine(tiny_model, None, "cpu", long_prefill_token_threshold=given) as engine:
        assert engine.config.long_prefill_token_threshold == resolved
        assert engine.scheduler.config.long_prefill_token_threshold == resolved
