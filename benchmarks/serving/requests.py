"""The serving benchmark's requests: the same token ids as v2 JSON bodies, binary tensor data and gRPC messages, so
that every protocol and server is sent the same work."""

from __future__ import annotations

import json

import numpy as np

from contract.binary_tensors import HEADER_NAME
from loadtest.http_client import post_bytes

TOKENS = 32


def request_ids(n: int, batch: int = 1, seed: int = 0, tokens: int = TOKENS) -> list[np.ndarray]:
    """n different (batch, tokens) token-id arrays: the same requests in every protocol."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 260, size=(batch, tokens)) for _ in range(n)]  # each (B, T)


def request_bodies(n: int, batch: int = 1, seed: int = 0, tokens: int = TOKENS) -> list[bytes]:
    """n different v2 JSON bodies of `batch` rows x `tokens` token ids."""
    bodies = []
    for ids in request_ids(n, batch, seed, tokens):
        tensor = {"name": "input_ids", "datatype": "INT64", "shape": list(ids.shape), "data": ids.ravel().tolist()}
        bodies.append(json.dumps({"inputs": [tensor]}).encode())
    return bodies


def binary_requests(path: str, n: int, batch: int = 1, tokens: int = TOKENS) -> list[bytes]:
    """The same requests in the binary tensor data extension, logits asked back binary (tritonclient's defaults)."""
    out = []
    for ids in request_ids(n, batch, tokens=tokens):
        raw = ids.astype("<i8").tobytes()
        tensor = {"name": "input_ids", "datatype": "INT64", "shape": list(ids.shape)}
        tensor["parameters"] = {"binary_data_size": len(raw)}
        header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
        out.append(post_bytes(path, header + raw, {HEADER_NAME: str(len(header))}))
    return out
