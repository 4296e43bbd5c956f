"""Time from arrival, and admission, in the data plane and a decoder's deployment, in process (no Ray): time to first
token, queue time and a client gone's end-to-end latency count from when the request's head arrived; a decoder in its
own deployment gets the request's age and counts from the same moment; every check of a request against the model
(stop strings included) runs before any Ray call; generation holds its own share of the in-flight limit; and a
request's 400 from decoding it is counted like a classifier's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import export_tiny_decoder

from contract.decoder_metadata import DecoderMetadata
from contract.tokenizer import ByteTokenizer
from service.config import AppConfig
from service.dataplane import DataPlane, Endpoint
from service.decoder_placement import ColocatedDecoder
from service.deployment import DecoderServer
from service.errors import BadRequestError, OverCapacityError, SamplingParamsError
from service.generate import GenerateRequest, GenerationSettings, SamplingParams
from service.inference import ModelStatus
from service.remote_decoder import RemoteDecoder

LM = "lm-h4-kv2-d32"  # context 64
AGE_S = 0.5  # how long before the call the request's head arrived
ENDPOINT = Endpoint("test")
SETTINGS = GenerationSettings(threads=1, backend="cpu")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("arrival-models")
    export_tiny_decoder(out, 2, 64, seed=3)
    return out


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _Recorded:
    """What a data plane recorded: time to first token, each ended generation, and each request's status code."""

    def __init__(self, plane: DataPlane) -> None:
        self.first_token: list[float] = []
        self.finished: list[tuple[str, float]] = []
        self.codes: list[tuple[int, bool]] = []
        metrics = plane.generation_metrics
        metrics.token_event, metrics.generation_finished = self.token_event, self.generation_finished
        metrics.queued = metrics.prompt_tokens = lambda *args: None
        plane.metrics.finished = self.request_finished

    def token_event(self, labels: dict, tokens: int, since_s: float, first: bool) -> None:
        if tokens and first:
            self.first_token.append(since_s)

    def generation_finished(self, labels: dict, reason: str, seconds: float) -> None:
        self.finished.append((reason, seconds))

    def request_finished(self, labels: dict, endpoint: str, code: int, elapsed_s: float, rejected: bool) -> None:
        self.codes.append((code, rejected))


def _run(models_dir: Path, test, **limits) -> None:
    """`await test(plane, recorded)` over a data plane serving LM co-located."""

    async def run() -> None:
        decoder = ColocatedDecoder.open(str(models_dir), LM, SETTINGS)
        config = AppConfig(models_dir=str(models_dir), models=[LM], limits=limits)
        plane = DataPlane(config, {LM: decoder})
        try:
            await test(plane, _Recorded(plane))
            await asyncio.sleep(0)  # admission records each request's code on the next turn of the loop
        finally:
            decoder.close()

    asyncio.run(run())


def test_time_to_first_token_and_queue_time_count_from_the_requests_arrival_not_its_admission(models_dir):
    async def test(plane: DataPlane, recorded: _Recorded) -> None:
        request = GenerateRequest("hi", _greedy(4), arrived=time.perf_counter() - AGE_S)
        events = [event async for _, event in plane.generate(ENDPOINT, LM, request)]
        assert AGE_S <= recorded.first_token[0] < AGE_S + 5, recorded.first_token
        last = events[-1]
        assert last.finish_reason is not None and AGE_S <= last.timing.queued_s <= last.timing.first_token_s
        assert recorded.finished == [("length", last.timing.total_s)] and last.timing.total_s >= AGE_S

    _run(models_dir, test)


def test_a_client_gone_counts_its_end_to_end_latency_from_the_requests_arrival(models_dir):
    async def test(plane: DataPlane, recorded: _Recorded) -> None:
        request = GenerateRequest("hi", _greedy(60), arrived=time.perf_counter() - AGE_S)
        events = plane.generate(ENDPOINT, LM, request)
        await anext(events)
        await events.aclose()  # the client went away after its first token
        assert [reason for reason, _ in recorded.finished] == ["abort"]
        assert AGE_S <= recorded.finished[0][1] < AGE_S + 5, recorded.finished

    _run(models_dir, test)


def test_a_generation_request_that_fails_to_decode_is_admitted_first_and_counted_as_a_400(models_dir):
    def decoded(model: str) -> GenerateRequest:
        return GenerateRequest("hi", SamplingParams(temperature=-1.0))

    async def test(plane: DataPlane, recorded: _Recorded) -> None:
        with pytest.raises(SamplingParamsError):
            await anext(plane.generate(ENDPOINT, LM, decoded))
        await asyncio.sleep(0)
        assert recorded.codes == [(400, False)]

    _run(models_dir, test)


def test_streams_past_generations_share_of_the_in_flight_limit_get_a_503_and_leave_room_for_a_classifier(models_dir):
    """max_in_flight 3, generation's share 2: a third stream is refused (a rejection) while a request of any other
    kind is still admitted."""

    async def test(plane: DataPlane, recorded: _Recorded) -> None:
        held = [plane.generate(ENDPOINT, LM, GenerateRequest("hi", _greedy(60))) for _ in range(2)]
        for events in held:
            await anext(events)
        with pytest.raises(OverCapacityError) as refused:
            await anext(plane.generate(ENDPOINT, LM, GenerateRequest("hi", _greedy(4))))
        assert "max_generation_in_flight" in str(refused.value)
        async with plane.admit(ENDPOINT, LM):  # a classifier's admission: the third request in flight
            pass
        for events in held:
            await events.aclose()
        await asyncio.sleep(0)
        assert sorted(recorded.codes) == [(200, False), (499, False), (499, False), (503, True)]

    _run(models_dir, test, max_in_flight=3, max_generation_in_flight=2)


class _Method:
    """A deployment handle's method: its calls kept, each answered by `answer(*args)`."""

    def __init__(self, answer) -> None:
        self.calls: list[tuple] = []
        self._answer = answer

    def remote(self, *args):
        self.calls.append(args)
        return self._answer(*args)


class _Response:
    def cancel(self) -> None:
        pass


class _Handle:
    """A decoder deployment's handle, in process: its status, and generate calls kept unanswered."""

    def __init__(self, meta: DecoderMetadata) -> None:
        async def status() -> ModelStatus:
            return ModelStatus(meta.name, True, "", "cpu", 1, meta)

        self.status = _Method(lambda: status())
        self.generate = _Method(lambda *args: _Response())

    def options(self, **kwargs) -> _Handle:
        return self


def _ids_only() -> DecoderMetadata:
    return DecoderMetadata("lm-ids", 4, 2, 8, 32, 2, 260, 64, 1, 2, 0, tokenizer="ids")


def test_a_decoder_in_its_own_deployment_gets_the_requests_token_ids_and_age_not_its_arrival():
    handle = _Handle(DecoderMetadata("lm-text", 4, 2, 8, 32, 2, 260, 64, 1, 2, 0))
    decoder = RemoteDecoder("lm-text", handle)
    asyncio.run(decoder.status())
    decoder.submit(GenerateRequest("hi", _greedy(4), arrived=time.perf_counter() - AGE_S))
    [(sent, age_s)] = handle.generate.calls
    assert sent.arrived is None and AGE_S <= age_s < AGE_S + 5
    assert sent.prompt == tuple(ByteTokenizer(64).encode("hi"))


def test_a_stop_string_for_a_model_of_token_ids_is_a_400_before_any_ray_call():
    handle = _Handle(_ids_only())
    decoder = RemoteDecoder("lm-ids", handle)
    asyncio.run(decoder.status())
    with pytest.raises(SamplingParamsError, match="makes token ids, no text"):
        decoder.submit(GenerateRequest((5, 6), SamplingParams(stop=["x"])))
    assert handle.generate.calls == []
    assert GenerateRequest((5, 6)).checked(_ids_only()).prompt == (5, 6)


def test_a_decoders_replica_counts_queue_time_and_first_token_from_the_age_it_was_sent(models_dir):
    async def run() -> None:
        server = DecoderServer.func_or_class(str(models_dir), LM, SETTINGS)
        try:
            events = [e async for e in server.generate(GenerateRequest((1, 2, 3), _greedy(4)), AGE_S)]
        finally:
            server._decoder.close()
        timing = events[-1].timing
        assert AGE_S <= timing.queued_s <= timing.first_token_s <= timing.total_s < AGE_S + 5, timing

    asyncio.run(run())


def test_a_request_of_several_sequences_counts_each_in_generations_share_and_one_over_the_share_is_a_400(models_dir):
    """Generation's share is 2: three sequences in one request can never be admitted (a 400 that says so); two are
    refused with a 503 while another stream holds one of the two, and admitted once it has left."""

    async def test(plane: DataPlane, recorded: _Recorded) -> None:
        three = [GenerateRequest("hi", _greedy(4)) for _ in range(3)]
        with pytest.raises(BadRequestError, match=r"3 sequences .* can never be admitted"):
            await anext(plane.generate(ENDPOINT, LM, three))
        held = plane.generate(ENDPOINT, LM, GenerateRequest("hi", _greedy(60)))
        await anext(held)
        with pytest.raises(OverCapacityError):
            await anext(plane.generate(ENDPOINT, LM, three[:2]))
        await held.aclose()
        indices = sorted({index async for index, _ in plane.generate(ENDPOINT, LM, three[:2])})
        assert indices == [0, 1]
        await asyncio.sleep(0)
        assert [code for code, _ in recorded.codes] == [400, 503, 499, 200]  # the held one ends at its close

    _run(models_dir, test, max_in_flight=3, max_generation_in_flight=2)
