"""`python -m contract.rpc.generate`: the Python modules of inference.proto (messages and the service's stubs), written
beside it by grpcio-tools' protoc. They are committed; tests/test_grpc.py checks that they match the .proto."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: the generated modules import `contract.rpc....`
PROTO = Path("contract/rpc/inference.proto")


def generate(out: Path) -> None:
    """inference_pb2.py and inference_pb2_grpc.py of PROTO under `out` (as contract/rpc/...)."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out}", f"--grpc_python_out={out}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


if __name__ == "__main__":
    try:
        generate(ROOT)
    except ModuleNotFoundError:
        print("contract.rpc.generate: grpcio-tools is not installed (pip install -e '.[test]')", file=sys.stderr)
        raise SystemExit(2) from None
