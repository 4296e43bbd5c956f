"""`python -m contract.rpc.generate`: the Python modules of each .proto here (messages and the services' stubs), written
beside it by grpcio-tools' protoc. They are committed; tests/test_grpc.py and tests/test_generation_grpc.py check
that they match the .proto files."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: the generated modules import `contract.rpc....`
PROTOS = (Path("contract/rpc/inference.proto"), Path("contract/rpc/generation.proto"))


def generate(out: Path) -> None:
    """<name>_pb2.py and <name>_pb2_grpc.py of each of PROTOS under `out` (as contract/rpc/...)."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = ["protoc", f"-I{ROOT}", f"--python_out={out}", f"--grpc_python_out={out}", str(ROOT / proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


if __name__ == "__main__":
    try:
        generate(ROOT)
    except ModuleNotFoundError:
        print("contract.rpc.generate: grpcio-tools is not installed (pip install -e '.[test]')", file=sys.stderr)
        raise SystemExit(2) from None
