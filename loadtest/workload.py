"""What each request carries: a sequence-length distribution, texts made to those lengths, and request bodies.

Texts are generated here (ASCII words, seeded), so a text of n characters is n + 1 tokens under the service's byte
tokenizer (1 BOS + one token per UTF-8 byte). Lengths below are in tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadtest import binary

PROTOCOLS = ("simple", "v2", "v2-binary", "grpc")  # v2-binary: v2 with the binary tensor data extension
DEFAULT_PROTOCOL = "simple"
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"  # the gRPC method a `grpc` request calls
_WORDS = (
    "attention",
    "head",
    "query",
    "key",
    "value",
    "token",
    "layer",
    "model",
    "serve",
    "batch",
    "replica",
    "latency",
    "route",
    "scale",
    "vector",
    "matrix",
    "softmax",
    "encoder",
    "embed",
    "weight",
    "bias",
    "input",
    "output",
    "signal",
    "queue",
    "cache",
)


class WorkloadError(ValueError):
    """A sequence-length spec, text file or protocol that cannot produce requests."""


@dataclass(frozen=True)
class SeqLenSpec:
    """`fixed:N`, `uniform:LO:HI` (tokens, BOS included) or `file:PATH` (one text per line)."""

    kind: str
    low: int = 0
    high: int = 0
    path: str = ""

    @classmethod
    def parse(cls, text: str) -> SeqLenSpec:
        kind, _, rest = text.partition(":")
        try:
            if kind == "fixed":
                spec = cls("fixed", int(rest), int(rest))
            elif kind == "uniform":
                low, high = (int(x) for x in rest.split(":"))
                spec = cls("uniform", low, high)
            elif kind == "file" and rest:
                return cls("file", path=rest)
            else:
                raise ValueError(kind)
        except ValueError:
            raise WorkloadError(
                f"--seq-len {text!r} is not one of fixed:N, uniform:LO:HI or file:PATH (N, LO, HI in tokens)"
            ) from None
        if spec.low < 2 or spec.high < spec.low:
            raise WorkloadError(f"--seq-len {text!r}: lengths must be >= 2 tokens (1 BOS + 1 byte) and LO <= HI")
        return spec

    def describe(self) -> str:
        if self.kind == "file":
            return f"file:{self.path}"
        return f"fixed:{self.low}" if self.kind == "fixed" else f"uniform:{self.low}:{self.high}"


@dataclass(frozen=True)
class RequestBody:
    """One request, already serialized: its bytes, how many sequences it carries and their token count, and the
    HTTP header fields it needs besides the JSON content type (v2-binary's header length)."""

    content: bytes
    sequences: int
    tokens: int
    headers: tuple[tuple[str, str], ...] = ()


def make_text(rng: random.Random, chars: int) -> str:
    """An ASCII text of exactly `chars` characters (so `chars + 1` tokens): words separated by spaces."""
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def read_texts(path: str) -> list[str]:
    """The non-empty lines of a UTF-8 text file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"--seq-len file:{path}: cannot read the file ({exc})") from None
    texts = [line.strip() for line in lines if line.strip()]
    if not texts:
        raise WorkloadError(f"--seq-len file:{path}: the file has no non-empty lines")
    return texts


def _fit(text: str, max_len: int) -> tuple[str, bool]:
    """Cut a text to at most max_len - 1 UTF-8 bytes (at a character boundary); True when it was cut."""
    data = text.encode("utf-8")
    if len(data) + 1 <= max_len:
        return text, False
    return data[: max_len - 1].decode("utf-8", errors="ignore"), True


def make_texts(spec: SeqLenSpec, max_len: int, count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """`count` texts drawn from the spec for a model with `max_len`, and notes on anything adjusted to fit."""
    rng = random.Random(seed)
    notes: list[str] = []
    if spec.kind == "file":
        source = read_texts(spec.path)
        fitted = [_fit(source[i % len(source)], max_len) for i in range(count)]
        cut = sum(1 for _, was_cut in fitted if was_cut)
        if cut:
            notes.append(f"{cut} of {count} texts from {spec.path} cut to max_len={max_len} tokens")
        return [text for text, _ in fitted], notes
    high = min(spec.high, max_len)
    low = min(spec.low, high)
    if (low, high) != (spec.low, spec.high):
        notes.append(f"seq-len {spec.describe()} clamped to {low}..{high} tokens (model max_len={max_len})")
    return [make_text(rng, rng.randint(low, high) - 1) for _ in range(count)], notes


def parse_protocols(text: str) -> tuple[str, ...]:
    """`--protocol`'s comma-separated list, in the order given."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PROTOCOLS]
    if unknown or not names:
        what = f"unknown protocol(s) {', '.join(unknown)}" if unknown else "no protocol"
        raise WorkloadError(f"--protocol {text!r}: {what}; give one or more of {', '.join(PROTOCOLS)}, comma-separated")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise WorkloadError(f"--protocol {text!r} names {', '.join(twice)} more than once")
    return tuple(names)


def endpoint(protocol: str, model: str) -> str:
    """The path a request for `model` goes to under `protocol`."""
    if protocol == "simple":
        return f"/v1/models/{model}/predict"
    if protocol in ("v2", "v2-binary"):
        return f"/v2/models/{model}/infer"
    if protocol == "grpc":
        return GRPC_INFER
    raise WorkloadError(f"--protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")


# What a 200 answer must also be, by protocol (a protocol not here: any 200)
ANSWER_CHECKS = {"v2-binary": binary.answer_problem}


def request_body(protocol: str, texts: list[str], model: str = "") -> RequestBody:
    """One request of `texts` under `protocol`, to `model` (gRPC names it in the message)."""
    tokens = sum(len(t.encode("utf-8")) + 1 for t in texts)
    if protocol == "v2-binary":
        content, header_length = binary.encode_request(texts)
        return RequestBody(content, len(texts), tokens, ((binary.HEADER_NAME, str(header_length)),))
    return RequestBody(encode_body(protocol, texts, model), len(texts), tokens)


def encode_body(protocol: str, texts: list[str], model: str = "") -> bytes:
    """The request body for a batch of texts: JSON, for `grpc` a serialized ModelInferRequest to `model`, for
    `v2-binary` a JSON header and binary data (`request_body` gives the header's length too)."""
    if protocol == "grpc":
        from contract.rpc import inference_pb2 as pb

        message = pb.ModelInferRequest(model_name=model)
        text = message.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
        text.contents.bytes_contents.extend(t.encode("utf-8") for t in texts)
        return message.SerializeToString()
    if protocol == "v2-binary":
        return binary.encode_request(texts)[0]
    if protocol == "simple":
        payload: dict = {"texts": texts}
    elif protocol == "v2":
        payload = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
    else:
        raise WorkloadError(f"--protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    return json.dumps(payload, separators=(",", ":")).encode("utf-8")


def build_bodies(
    spec: SeqLenSpec,
    max_len: int,
    batch_size: int,
    protocols: tuple[str, ...],
    pool: int = 64,
    seed: int = 0,
    model: str = "",
) -> tuple[dict[str, list[RequestBody]], list[str]]:
    """A pool of serialized request bodies per protocol (cycled through during a run), the same texts in each, and
    the notes from fitting the texts."""
    if batch_size < 1:
        raise WorkloadError(f"--batch-size must be >= 1, got {batch_size}")
    texts, notes = make_texts(spec, max_len, pool * batch_size, seed)
    batches = [texts[i * batch_size : (i + 1) * batch_size] for i in range(pool)]
    return {p: [request_body(p, batch, model) for batch in batches] for p in protocols}, notes
