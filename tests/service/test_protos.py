"""The committed gRPC stubs are what `make protos` generates from protos/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("specdec_pb2.py", "specdec_pb2.pyi", "specdec_pb2_grpc.py")


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(ROOT / "protos/specdec/v1/specdec.proto")],
        check=True)
    for name in GENERATED:
        fresh = (tmp_path / "specdec/v1" / name).read_text()
        committed = (ROOT / "specdec/v1" / name).read_text()
        assert fresh == committed, f"specdec/v1/{name} is stale: run `make protos`"


def test_stubs_import_from_the_package() -> None:
    from specdec.v1 import specdec_pb2, specdec_pb2_grpc

    assert specdec_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name == "specdec.v1.Verifier"
    assert hasattr(specdec_pb2_grpc, "DrafterStub")
