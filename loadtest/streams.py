"""The generation workload: streamed completions to decoders, and what the client times in each stream.

Each request asks for an exact number of output tokens (`ignore_eos`) after a prompt of a drawn length, over
`openai` (POST /openai/v1/completions with `stream: true`), `oip` (POST /v2/models/{name}/generate_stream) or `grpc`
(the GenerationService's server-streaming ModelGenerate). Every answer is a stream of events, one per engine step of
the sequence (one token each, its text possibly empty while a UTF-8 character is incomplete), so the client's clock
at each event is that token's arrival.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from types import ModuleType

from loadtest.grpc_client import GrpcPool
from loadtest.http_client import ConnectionPool, HTTPError, Response
from loadtest.workload import RequestBody, WorkloadError, make_text

GENERATION_PROTOCOLS = ("openai", "oip", "grpc")
DEFAULT_GENERATION_PROTOCOL = "openai"
GRPC_GENERATE = "/mha.generation.GenerationService/ModelGenerate"
DECODER = "decoder"  # a model's `arch` in the service's listing
_DONE = b"[DONE]"


@dataclass(frozen=True)
class TokenSpec:
    """A token count per request: `N` (fixed) or `LO:HI` (uniform, both included)."""

    low: int
    high: int
    flag: str = "--output-tokens"

    @classmethod
    def parse(cls, text: str, flag: str, least: int) -> TokenSpec:
        try:
            parts = [int(x) for x in text.split(":")]
        except ValueError:
            parts = []
        if len(parts) not in (1, 2):
            raise WorkloadError(f"{flag} {text!r} is not N or LO:HI (tokens)")
        low, high = parts[0], parts[-1]
        if low > high:
            raise WorkloadError(f"{flag} {text!r}: LO must be <= HI")
        if low < least:
            raise WorkloadError(f"{flag} {text!r}: at least {least} token(s) per request")
        return cls(low, high, flag)

    def describe(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class StreamTiming:
    """One successful stream as the client saw it, in seconds from its send (an open loop's: its scheduled send):
    each token event's arrival, the end of the stream, and the output tokens (the server's count where the stream
    gives one, else its token events)."""

    arrivals: tuple[float, ...]
    e2e_s: float
    tokens: int
    prompt_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] if self.arrivals else self.e2e_s

    @property
    def gaps_s(self) -> tuple[float, ...]:
        """The inter-token latencies: between consecutive token events."""
        return tuple(b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False))

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - TTFT) / (tokens - 1); None for one token."""
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class _Events:
    """Server-sent events parsed as the bytes arrive: each event's payload with the clock when it was complete."""

    start: float
    buffer: bytes = b""
    events: list[tuple[float, bytes]] = field(default_factory=list)

    def message(self, data: bytes) -> None:
        """One gRPC answer message: an event of its own."""
        self.events.append((time.perf_counter() - self.start, data))

    def feed(self, piece: bytes) -> None:
        at = time.perf_counter() - self.start
        self.buffer += piece.replace(b"\r\n", b"\n")
        *complete, self.buffer = self.buffer.split(b"\n\n")
        for event in complete:
            data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if data:
                self.events.append((at, data))


def endpoint(protocol: str, model: str) -> str:
    if protocol == "openai":
        return "/openai/v1/completions"
    if protocol == "oip":
        return f"/v2/models/{model}/generate_stream"
    if protocol == "grpc":
        return GRPC_GENERATE
    raise WorkloadError(f"--protocol {protocol!r} does not generate; give one of {', '.join(GENERATION_PROTOCOLS)}")


def generation_pb2() -> ModuleType:
    """contract/rpc/generation_pb2, imported only for `--protocol grpc` (the HTTP protocols need no protobuf)."""
    try:
        from contract.rpc import generation_pb2 as pb
    except ImportError as exc:
        raise WorkloadError(f"--protocol grpc: the generation RPC's messages do not import ({exc})") from None
    return pb


def encode_body(protocol: str, model: str, prompt: str, max_tokens: int) -> bytes:
    """A request for exactly `max_tokens` tokens after `prompt`, greedy, past EOS."""
    if protocol == "grpc":
        pb = generation_pb2()
        params = pb.GenerateParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return pb.ModelGenerateRequest(model_name=model, text_input=prompt, parameters=params).SerializeToString()
    if protocol == "openai":
        payload: dict = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        payload |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    elif protocol == "oip":
        payload = {"text_input": prompt, "parameters": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    else:
        endpoint(protocol, model)
    return json.dumps(payload, separators=(",", ":")).encode("utf-8")


def build_bodies(
    prompt: TokenSpec,
    output: TokenSpec,
    max_len: int,
    protocols: tuple[str, ...],
    model: str,
    pool: int = 64,
    seed: int = 0,
) -> tuple[dict[str, list[RequestBody]], list[str]]:
    """A pool of request bodies per protocol (the same prompts and lengths in each), cycled through during a run;
    prompts are cut so that prompt + output fits the model's context, with a note. RequestBody.tokens is the
    prompt's (one sequence each)."""
    room = max_len - output.high
    if room < 2:
        raise WorkloadError(
            f"{output.flag} {output.describe()} leaves no room for a prompt in {model}'s context of {max_len} tokens"
        )
    notes = []
    high, low = min(prompt.high, room), min(prompt.low, room)
    if (low, high) != (prompt.low, prompt.high):
        notes.append(f"prompt tokens {prompt.describe()} cut to {low}..{high} (context {max_len} - {output.high} out)")
    rng = random.Random(seed)
    drawn = [(rng.randint(low, high), output.draw(rng)) for _ in range(pool)]
    texts = [(make_text(rng, n - 1), n, m) for n, m in drawn]  # n - 1 bytes after BOS: n tokens
    bodies = {p: [RequestBody(encode_body(p, model, t, m), 1, n) for t, n, m in texts] for p in protocols}
    return bodies, notes


def _error_of(payload: dict) -> str:
    error = payload.get("error")
    return (error.get("message", str(error)) if isinstance(error, dict) else str(error)) if error else ""


def _openai(events: list[tuple[float, bytes]]) -> tuple[list[float], int | None, str, str]:
    """Token arrivals, the usage's completion tokens (None without), the finish reason, an error ("" when none)."""
    arrivals, tokens, finish = [], None, ""
    if not events or events[-1][1] != _DONE:
        return [], None, "", "the stream ended before data: [DONE]"
    for at, data in events[:-1]:
        payload = json.loads(data)
        if error := _error_of(payload):
            return arrivals, tokens, finish, error
        if payload.get("choices"):
            arrivals.append(at)
            finish = payload["choices"][0].get("finish_reason") or finish
        if isinstance(payload.get("usage"), dict):
            tokens = payload["usage"].get("completion_tokens")
    return arrivals, tokens, finish, ""


def _oip(events: list[tuple[float, bytes]]) -> tuple[list[float], int | None, str, str]:
    arrivals, tokens, finish = [], None, ""
    for at, data in events:
        payload = json.loads(data)
        if error := _error_of(payload):
            return arrivals, tokens, finish, error
        arrivals.append(at)
        if isinstance(details := payload.get("details"), dict):
            tokens, finish = details.get("generated_tokens"), details.get("finish_reason", "")
    if not finish:
        return arrivals, tokens, finish, "the stream ended without details (its finish reason)"
    return arrivals, tokens, finish, ""


def _grpc(events: list[tuple[float, bytes]]) -> tuple[list[float], int | None, str, str]:
    pb = generation_pb2()
    arrivals, tokens, finish = [], None, ""
    for at, data in events:
        message = pb.ModelGenerateResponse.FromString(data)
        arrivals.append(at)
        if message.HasField("details"):
            tokens, finish = message.details.generated_tokens, message.details.finish_reason
    if not finish:
        return arrivals, tokens, finish, "the stream ended without details (its finish reason)"
    return arrivals, tokens, finish, ""


_READERS = {"openai": _openai, "oip": _oip, "grpc": _grpc}


async def stream_request(
    pool: ConnectionPool | GrpcPool, path: str, protocol: str, body: RequestBody, start: float
) -> tuple[str, str, StreamTiming | None]:
    """Send one streamed request, timing each event from `start` (perf_counter); ("", "", timing) for a stream that
    ended well, else (status code, transport error kind, `stream_error` or `abort`; a message; None)."""
    events = _Events(start)
    try:
        if isinstance(pool, GrpcPool):
            response = await pool.stream(path, body.content, events.message)
        else:
            response = await pool.post(path, body.content, body.headers, on_data=events.feed)
    except HTTPError as exc:
        return exc.kind, str(exc), None
    e2e = time.perf_counter() - start
    if response.status != 200:
        return str(response.status), _refusal(response), None
    try:
        arrivals, tokens, finish, error = _READERS[protocol](events.events)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return "stream_error", f"an unreadable event: {exc.__class__.__name__}: {exc}", None
    if error:
        return "stream_error", error, None
    if finish == "abort":
        return "abort", f"the server ended the stream after {len(arrivals)} token event(s) (finish_reason abort)", None
    return "", "", StreamTiming(tuple(arrivals), e2e, len(arrivals) if tokens is None else tokens, body.tokens)


def _refusal(response: Response) -> str:
    try:
        payload = json.loads(response.body)
    except ValueError:
        return response.body[:300].decode("utf-8", errors="replace")
    return _error_of(payload) if isinstance(payload, dict) and payload.get("error") else str(payload)[:300]
