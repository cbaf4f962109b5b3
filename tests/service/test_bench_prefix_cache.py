"""`python -m specdec bench prefix-cache`: its flags' checks (the figures are a benchmark's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.__main__ import main
from tests.support.tiny_models import make_tiny_llama


def test_no_speculative_method_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The engine is measured with its drafter: an empty --speculative-config (off) is a
    flag error, not a crash when the drafter is started without a method."""
    model = make_tiny_llama(tmp_path / "tiny")
    assert main(["bench", "prefix-cache", "--model", str(model), "--dtype", "float32",
                 "--speculative-config", ""]) == 2
    assert "--speculative-config must name a method" in caplog.text
