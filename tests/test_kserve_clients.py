"""KServe's own inference clients, unmodified, against the served app: InferenceRESTClient (v2; binary tensor data
as its InferInput sends by default, JSON, and binary outputs) and InferenceGRPCClient (raw and typed contents), ids
and masks as INT64 and text as BYTES for every tiny model, logits against ONNX Runtime in process.

The clients run in a process of their own (`in_own_process`): `import kserve` alone loads KServe's generated
`inference.*` messages, which clash with ours in one process."""

from __future__ import annotations

import json

import numpy as np
import pytest
from serving import bare_logits, deployed, in_own_process, models_when_ready

from contract.tokenizer import ByteTokenizer
from service.local.ports import free_port

pytestmark = pytest.mark.serve

UNKNOWN = "mha-nope"
IDS = np.random.default_rng(11).integers(4, 260, size=(3, 7)).astype(np.int64)  # (B, T)
MASK = np.ones_like(IDS)
MASK[2, 4:] = 0  # a padded row
TEXTS = ["a short one", "and a somewhat longer text"]

KSERVE_CLIENTS = """
import asyncio, json, sys
import grpc, httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

base_url, grpc_url, unknown, names, ids, mask, texts = *sys.argv[1:4], *map(json.loads, sys.argv[4:])
ids, mask = np.array(ids, dtype=np.int64), np.array(mask, dtype=np.int64)
text = np.array([t.encode() for t in texts], dtype=np.object_)


def tensor(name, datatype, array, binary):
    item = InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array, binary_data=binary)
    return item


def requests(name, binary=True, parameters=None):
    # new InferInputs for every call: the clients rewrite an input's data while they encode it
    pair = [tensor("input_ids", "INT64", ids, binary), tensor("attention_mask", "INT64", mask, binary)]
    return {
        "ids": InferRequest(name, pair, request_id=f"k-{name}", parameters=parameters),
        "text": InferRequest(name, [tensor("text", "BYTES", text, binary)], parameters=parameters),
    }


async def refused(call):
    try:
        await call
    except httpx.HTTPStatusError as error:
        return [error.response.status_code, str(error)]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]


def tensors(items):
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]


async def main():
    rest = InferenceRESTClient(RESTConfig(protocol="v2"))
    rpc = InferenceGRPCClient(grpc_url)
    answered = {}  # the last REST answer's headers

    def rest_infer(request):
        return rest.infer(base_url, request, model_name=request.model_name, response_headers=answered)

    ways = {  # way -> (infer, binary inputs, request parameters)
        "rest": (rest_infer, True, None),
        "rest json": (rest_infer, False, None),
        "rest binary out": (rest_infer, True, {"binary_data_output": True}),
        "grpc": (rpc.infer, True, None),
        "grpc typed contents": (rpc.infer, False, None),
    }
    out = {"ways": list(ways), "logits": {}, "ids": {}, "binary answers": []}
    for name in names:
        for way, (infer, binary, parameters) in ways.items():
            for kind, request in requests(name, binary, parameters).items():
                answered.clear()
                response = await infer(request)
                key = f"{name}|{way}|{kind}"
                out["logits"][key] = response.get_output_by_name("logits").as_numpy().tolist()
                out["ids"][key] = response.id
                if any(h.lower() == "inference-header-content-length" for h in answered):
                    out["binary answers"].append(key)
    out["rest"] = {
        "live": await rest.is_server_live(base_url),
        "ready": await rest.is_server_ready(base_url),
        "models ready": [await rest.is_model_ready(base_url, name) for name in names],
        "unknown ready": await rest.is_model_ready(base_url, unknown),
        "unknown infer": await refused(rest_infer(requests(unknown)["text"])),
    }
    out["grpc"] = {
        "live": await rpc.is_server_live(),
        "ready": await rpc.is_server_ready(),
        "models ready": [await rpc.is_model_ready(name) for name in names],
        "unknown ready": await refused(rpc.is_model_ready(unknown)),
        "unknown infer": await refused(rpc.infer(requests(unknown)["text"])),
    }
    await rest.close()
    await rpc.close()
    # the clients have no metadata calls: KServe's generated stub asks
    async with grpc.aio.insecure_channel(grpc_url) as channel:
        stub = GRPCInferenceServiceStub(channel)
        out["grpc"]["extensions"] = list((await stub.ServerMetadata(pb.ServerMetadataRequest())).extensions)
        out["grpc"]["metadata"] = {}
        for name in names:
            meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name=name))
            out["grpc"]["metadata"][name] = {
                "name": meta.name,
                "versions": list(meta.versions),
                "platform": meta.platform,
                "inputs": tensors(meta.inputs),
                "outputs": tensors(meta.outputs),
            }
    print(json.dumps(out))


asyncio.run(main())
"""


def _models(served) -> list[str]:
    """Every model the app serves: the conftest-made tiny ones."""
    return sorted(path.parent.name for path in served.models_dir.glob("*/model.onnx"))


@pytest.fixture(scope="module")
def app(serve_port, tiny_models_dir):
    """The tiny models with gRPC on a port of their own, every model ready. Co-located only: the ingress codes the
    v2 wire formats whichever the placement, and test_api_v2*.py and test_grpc.py run both placements."""
    settings = {"ingress": {"grpc_port": free_port()}}
    with deployed(serve_port, "kserve", tiny_models_dir, "colocated", **settings) as served:
        models_when_ready(served, set(_models(served)))
        yield served


@pytest.fixture(scope="module")
def answers(app) -> dict:
    """What KServe's clients got from `app`, every model asked every way (one client process)."""
    args = [json.dumps(a) for a in (_models(app), IDS.tolist(), MASK.tolist(), TEXTS)]
    return in_own_process(KSERVE_CLIENTS, app.base_url, app.grpc_url, UNKNOWN, *args)


def _logits(answers: dict, client: str | None = None) -> dict[tuple[str, str, str], np.ndarray]:
    """(model, way, kind) -> the logits KServe's client read, for one client's ways or all."""
    logits = {tuple(key.split("|")): np.array(value) for key, value in answers["logits"].items()}
    return {key: value for key, value in logits.items() if client in (None, key[1].split()[0])}


@pytest.mark.parametrize("client", ["rest", "grpc"])
def test_kserve_client_sends_ids_masks_and_text_every_way_and_gets_the_logits_of_ort(app, answers, client):
    text_ids, text_mask = ByteTokenizer(32).encode_batch(TEXTS)
    want = {}
    for name in _models(app):
        want[name, "ids"] = bare_logits(app.models_dir, name, IDS, MASK)
        want[name, "text"] = bare_logits(app.models_dir, name, text_ids, text_mask)
    got = _logits(answers, client)
    ways = [way for way in answers["ways"] if way.split()[0] == client]
    assert ways and sorted(got) == sorted((name, way, kind) for name, kind in want for way in ways)
    for (name, way, kind), logits in got.items():
        key = f"{name}|{way}|{kind}"
        np.testing.assert_allclose(logits, want[name, kind], atol=1e-6, rtol=0, err_msg=key)
        if kind == "ids":  # the text requests carry no id of ours
            assert answers["ids"][key] == f"k-{name}", key
        # binary outputs only where the REST request asked for them (gRPC always answers raw contents)
        assert (key in answers["binary answers"]) == ("binary out" in way), key


def test_kserve_rest_and_grpc_clients_get_the_same_logits_every_way(app, answers):
    logits = _logits(answers)
    for name in _models(app):
        for kind in ("ids", "text"):
            first, *others = (key for key in logits if key[0] == name and key[2] == kind)
            assert others
            for key in others:
                np.testing.assert_allclose(logits[key], logits[first], atol=1e-6, rtol=0, err_msg=f"{key} {first}")


@pytest.mark.parametrize("client", ["rest", "grpc"])
def test_kserve_client_sees_the_server_live_and_ready_and_every_model_ready(app, answers, client):
    health = answers[client]
    assert health["live"] is True and health["ready"] is True
    assert health["models ready"] == [True] * len(_models(app))


def test_kserve_grpc_stub_reads_the_model_metadata_http_serves(app, answers):
    assert "binary_tensor_data" in answers["grpc"]["extensions"]
    with app.client() as http:
        for name, meta in answers["grpc"]["metadata"].items():
            served = http.get(f"/v2/models/{name}").json()
            assert meta == {key: served[key] for key in meta}, name
    assert sorted(answers["grpc"]["metadata"]) == _models(app)


def test_kserve_clients_raise_their_own_errors_with_our_message_for_an_unknown_model(answers):
    said = f"unknown model {UNKNOWN!r}"
    rest, rpc = answers["rest"], answers["grpc"]
    assert rest["unknown ready"] is False  # the REST client reads a v2 readiness refusal as False
    assert rest["unknown infer"][0] == 404 and said in rest["unknown infer"][1], rest["unknown infer"]
    assert rpc["unknown ready"][0] == "NOT_FOUND" and said in rpc["unknown ready"][1], rpc["unknown ready"]
    assert rpc["unknown infer"][0] == "NOT_FOUND" and said in rpc["unknown infer"][1], rpc["unknown infer"]
