"""The Open Inference Protocol's binary tensor data extension (Triton's), as both ends write and read it: the head
field giving the JSON header's length, the extension's name, and the framing of BYTES elements. The server's
decoding is service/protocol/binary.py, a client's request loadtest/binary.py. No torch.
"""

from __future__ import annotations

from collections.abc import Iterable

HEADER_NAME = "Inference-Header-Content-Length"  # in a request's and an answer's head: the JSON header's bytes
EXTENSION = "binary_tensor_data"  # as GET /v2 lists it
BYTES_LENGTH = 4  # a BYTES element: this many bytes of little-endian length, then that many bytes


def encode_bytes(elements: Iterable[bytes]) -> bytes:
    """BYTES elements as binary tensor data."""
    return b"".join(len(e).to_bytes(BYTES_LENGTH, "little") + e for e in elements)
