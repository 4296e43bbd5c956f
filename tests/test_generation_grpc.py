"""Token generation over gRPC (contract/rpc/generation.proto's GenerationService.ModelGenerate) served by
`mha-serving serve` in the ingress replica: the streamed text is the HTTP Open Inference Protocol generate's, the last
message carries the finish reason and the token counts, a seeded sampled request repeats, refusals are gRPC statuses
with the HTTP error's message, and a call cancelled (or past its deadline) mid-stream frees its sequence's KV
reservation within a few engine steps."""

from __future__ import annotations

import asyncio
import filecmp
import json
import os
import time

import grpc
import httpx
import pytest
from conftest import export_tiny_decoder, export_tiny_model
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus import series_total

from benchmarks.harness.server import ServerProcess
from contract.rpc import generate
from contract.rpc import generation_pb2 as pb
from contract.rpc import generation_pb2_grpc as pb_grpc
from service.config import AppConfig
from service.dataplane import DataPlane
from service.decoder_placement import ColocatedDecoder
from service.generate import GenerationSettings, SchedulerState
from service.local.ports import free_port
from service.rpc.rpcs import GENERATION, INFERENCE
from service.rpc.server import GrpcServer

LM = "lm-h4-kv1-d32"  # the tiny decoder: context 64
LONG = "lm-h4-kv4-d32"  # a decoder with a long context (2048): its streams last seconds, for the cancel tests
CLASSIFIER = "mha-h2-d32"
KV_TOKENS = 2048  # generate.kv_cache_tokens: one full context of LONG, so a second LONG sequence waits for the first
PROMPT = "def f(x):"
PROMPT_TOKENS = 1 + len(PROMPT)  # BOS, then a token per byte

pytestmark = [pytest.mark.serve, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation-grpc-models")
    export_tiny_decoder(out, 1, 64, seed=1)
    export_tiny_decoder(out, 4, KV_TOKENS, seed=4)
    export_tiny_model(out, heads=2, seed=2)
    config = {"models_dir": str(out), "backend": "cpu", "generate": {"kv_cache_tokens": KV_TOKENS, "threads": 1}}
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # Ray's export every second, as tests/serving.py
    with ServerProcess(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield pb_grpc.GenerationServiceStub(channel)


def _request(model: str = LM, text: str = PROMPT, **parameters) -> pb.ModelGenerateRequest:
    return pb.ModelGenerateRequest(model_name=model, text_input=text, parameters=pb.GenerateParameters(**parameters))


def _greedy(**more) -> dict:
    return {"max_tokens": 24, "temperature": 0, "ignore_eos": True} | more


def _stream(stub, request: pb.ModelGenerateRequest) -> list[pb.ModelGenerateResponse]:
    return list(stub.ModelGenerate(request, timeout=60))


def _text(messages: list[pb.ModelGenerateResponse]) -> str:
    return "".join(m.text_output for m in messages)


def test_the_generated_generation_stubs_are_what_the_proto_generates(tmp_path):
    generate.generate(tmp_path)
    for name in ("generation_pb2.py", "generation_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "contract/rpc" / name, generate.ROOT / "contract/rpc" / name, shallow=False), name


def test_the_streamed_text_is_the_http_generate_text_and_the_last_message_has_the_finish_reason_and_counts(stub, http):
    whole = http.post(f"/v2/models/{LM}/generate", json={"text_input": PROMPT, "parameters": _greedy()})
    assert whole.status_code == 200, whole.text
    request = _request(**_greedy())
    request.id = "g1"
    messages = _stream(stub, request)
    assert len(messages) > 1 and _text(messages) == whole.json()["text_output"]
    assert all(m.model_name == LM and m.model_version == "1" and m.id == "g1" for m in messages)
    assert not any(m.HasField("details") for m in messages[:-1])
    details = messages[-1].details
    assert (details.finish_reason, details.prompt_tokens, details.generated_tokens) == ("length", PROMPT_TOKENS, 24)
    assert sum(len(m.token_ids) for m in messages) == 24


def test_logprobs_are_the_same_over_grpc_oip_generate_its_stream_and_openai_the_greedy_token_first(stub, http):
    """parameters.logprobs 3: every generated token's log-probability and 3 alternatives, the greedy token the
    likeliest, with the same values in gRPC messages, the OIP generate answer, its stream's events and OpenAI's
    completion of the same prompt."""
    messages = _stream(stub, _request(**_greedy(logprobs=3)))
    over_grpc = [
        (t.id, t.text, round(t.logprob, 6), [a.id for a in t.top_logprobs]) for m in messages for t in m.logprobs
    ]
    assert len(over_grpc) == 24 and [t[0] for t in over_grpc] == [i for m in messages for i in m.token_ids]
    assert all(top[0] == token and len(top) == 3 for token, _, _, top in over_grpc)
    body = {"text_input": PROMPT, "parameters": _greedy(logprobs=3)}
    whole = http.post(f"/v2/models/{LM}/generate", json=body).json()["logprobs"]
    with http.stream("POST", f"/v2/models/{LM}/generate_stream", json=body) as streamed:
        events = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data:")]
    for answer in (whole, [t for e in events for t in e["logprobs"]]):
        assert [(t["id"], t["text"], round(t["logprob"], 6), [a["id"] for a in t["top_logprobs"]]) for t in answer] == (
            over_grpc
        )
        assert all(t["top_logprobs"][0]["logprob"] == t["logprob"] and not t["special"] for t in answer)
    openai = http.post(
        "/openai/v1/completions", json={"model": LM, "prompt": PROMPT, **_greedy(), "logprobs": 3}
    ).json()["choices"][0]["logprobs"]
    assert [round(v, 6) for v in openai["token_logprobs"]] == [t[2] for t in over_grpc]
    assert openai["tokens"] == [t[1] for t in over_grpc]
    assert not _stream(stub, _request(**_greedy()))[0].logprobs, "none unless asked"


def test_a_stop_string_ends_the_streamed_text_before_it_with_finish_reason_stop_sequence(stub):
    text = _text(_stream(stub, _request(**_greedy())))
    stop = text[6:8]
    assert len(stop) == 2, text
    messages = _stream(stub, _request(**_greedy(stop=[stop])))
    assert _text(messages) == text[: text.index(stop)]
    assert messages[-1].details.finish_reason == "stop_sequence"


def test_a_seeded_sampled_request_repeats_and_is_the_http_text_for_the_same_seed(stub, http):
    sampled = {"max_tokens": 16, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    first = _text(_stream(stub, _request(**sampled)))
    assert _text(_stream(stub, _request(**sampled))) == first
    over_http = http.post(f"/v2/models/{LM}/generate", json={"text_input": PROMPT, "parameters": sampled})
    assert over_http.json()["text_output"] == first


def test_a_prompt_of_token_ids_is_used_as_it_is(stub):
    request = pb.ModelGenerateRequest(model_name=LM, prompt_token_ids=[1, 2, 3], parameters=pb.GenerateParameters())
    request.parameters.max_tokens = 5
    details = _stream(stub, request)[-1].details
    assert details.prompt_tokens == 3 and 1 <= details.generated_tokens <= 5


def test_refusals_are_grpc_statuses_with_the_http_errors_message(stub, http):
    refused = {
        "unknown model": ("nope", {}, grpc.StatusCode.NOT_FOUND, "unknown model 'nope'"),
        "a classifier": (CLASSIFIER, {}, grpc.StatusCode.INVALID_ARGUMENT, "is a classifier"),
        "a bad temperature": (LM, {"temperature": -1}, grpc.StatusCode.INVALID_ARGUMENT, "temperature=-1"),
        "logprobs over 20": (LM, {"logprobs": 21}, grpc.StatusCode.INVALID_ARGUMENT, "logprobs=21"),
        "over the context": (
            LM,
            {"max_tokens": 60},
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{PROMPT_TOKENS} tokens + max_tokens 60",
        ),
    }
    for case, (model, parameters, code, text) in refused.items():
        with pytest.raises(grpc.RpcError) as failed:
            _stream(stub, _request(model, **parameters))
        assert failed.value.code() == code and text in failed.value.details(), (case, failed.value.details())
        answer = http.post(f"/v2/models/{model}/generate", json={"text_input": PROMPT, "parameters": parameters})
        assert answer.json()["error"] == failed.value.details(), case
    both = pb.ModelGenerateRequest(model_name=LM, text_input=PROMPT, prompt_token_ids=[1, 2])
    with pytest.raises(grpc.RpcError) as failed:
        _stream(stub, both)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in failed.value.details()


def test_bytes_that_are_not_the_rpcs_message_are_invalid_argument_naming_the_message_not_unknown(server):
    """Decoded by gRPC itself, they were UNKNOWN with a Python DecodeError; the same for every RPC, streamed or not."""
    malformed = b"\x0a\x7fab"  # field 1 announces 127 bytes and holds 2
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        streamed = channel.unary_stream(f"/{GENERATION}/ModelGenerate")
        unary = channel.unary_unary(f"/{INFERENCE}/ModelInfer")
        for name, call in (
            ("ModelGenerateRequest", lambda: list(streamed(malformed, timeout=30))),
            ("ModelInferRequest", lambda: unary(malformed, timeout=30)),
        ):
            with pytest.raises(grpc.RpcError) as failed:
                call()
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value
            assert failed.value.details().startswith("malformed request message: ") and name in failed.value.details()


def test_grpc_health_answers_for_the_generation_service(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        request = health_pb2.HealthCheckRequest(service="mha.generation.GenerationService")
        check = health_pb2_grpc.HealthStub(channel).Check(request, timeout=30)
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def _long(max_tokens: int) -> pb.ModelGenerateRequest:
    request = pb.ModelGenerateRequest(model_name=LONG, prompt_token_ids=[1])
    request.parameters.CopyFrom(pb.GenerateParameters(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return request


def _ended(server, end_call, timeout_s: float = 60) -> tuple[SchedulerState, SchedulerState]:
    """In process, to read the engine's scheduler: the replica's own gRPC server (service/rpc/server.py) over a data
    plane with LONG's engine; a LONG call of KV_TOKENS - 1 tokens and `timeout_s`, ended by `end_call(call)`. The
    scheduler's state when the call had ended, and once LONG's running batch was empty again."""
    settings = GenerationSettings(kv_cache_tokens=KV_TOKENS, threads=1)
    placement = ColocatedDecoder.open(server.config["models_dir"], LONG, settings)
    plane = DataPlane(AppConfig(models_dir=server.config["models_dir"], models=[LONG]), {LONG: placement})

    async def scenario() -> tuple[SchedulerState, SchedulerState]:
        port = free_port()
        grpc_server = GrpcServer(plane, "127.0.0.1", port, plane.limits)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.GenerationServiceStub(channel).ModelGenerate(_long(KV_TOKENS - 1), timeout=timeout_s)
            await end_call(call)
            ended = placement.engine.state()
            deadline = time.monotonic() + 10
            while placement.engine.state().running and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
        await grpc_server.close(time.time())
        return ended, placement.engine.state()

    try:
        return asyncio.run(scenario())
    finally:
        placement.close()


def test_a_call_cancelled_mid_stream_leaves_the_running_batch_within_a_few_steps(server):
    async def cancelled(call) -> None:
        await call.read()  # the first message: the sequence runs
        call.cancel()

    ended, after = _ended(server, cancelled)
    print(f"steps from the cancel to the sequence's end: {after.steps - ended.steps}")
    assert after.running == 0 and after.kv_reserved_tokens == 0
    assert after.steps - ended.steps < KV_TOKENS // 8, "the sequence ran on after its call was cancelled"


def test_a_call_past_its_deadline_mid_stream_leaves_the_running_batch_within_a_few_steps(server):
    """The whole stream takes ~2000 steps of at least 0.4 ms: a deadline of 0.3 s passes mid-stream, and the server
    cancels the call then."""
    received = []

    async def past_deadline(call) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            async for message in call:
                received.append(message)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    ended, after = _ended(server, past_deadline, timeout_s=0.3)
    print(f"{len(received)} messages; steps from the deadline to the sequence's end: {after.steps - ended.steps}")
    assert received, "the deadline passed before the first message"
    assert after.running == 0 and after.kv_reserved_tokens == 0
    assert after.steps - ended.steps < KV_TOKENS // 8, "the sequence ran on past its call's deadline"


def test_calls_are_counted_under_the_grpc_generate_endpoint_and_a_cancelled_one_as_499(server, stub):
    """After the tests above (answered and refused calls), a call cancelled mid-stream."""
    cancelled = stub.ModelGenerate(_long(KV_TOKENS - 1), timeout=60)
    next(cancelled)
    cancelled.cancel()
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    codes = {"200": LM, "400": LM, "499": LONG}
    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        counts = {
            code: series_total(text, "ray_mha_requests_total", model=model, endpoint="grpc_generate", code=code)
            for code, model in codes.items()
        }
        if all(counts.values()):
            break
        time.sleep(1)
    assert all(counts.values()), counts
