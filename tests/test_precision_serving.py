"""Precision as a served axis: an int8 variant served beside its fp32 source in the session's Ray Serve, each saying its
precision (model list, prediction, v2 metadata, the metrics' `precision` label), and an fp16 file refused on the CPU
with the fix named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import export_tiny_model
from prometheus import PrometheusServer
from serving import bare_logits, deployed, models_when_ready

from contract.tokenizer import ByteTokenizer
from export.quantize import make_variant

pytestmark = pytest.mark.serve
ROOT = Path(__file__).resolve().parents[1]
APP = "precision"
FP32, INT8, FP16 = "mha-h2-d32", "mha-h2-d32-int8", "mha-h2-d32-fp16"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("precision-models")
    folder = export_tiny_model(out, heads=2, seed=5).folder
    make_variant(folder, "int8")
    make_variant(folder, "fp16")
    return out


@pytest.fixture(scope="module", params=["colocated", "deployment"])
def app(request, serve_port, models_dir):
    with deployed(serve_port, f"{APP}-{request.param}", models_dir, request.param) as served:
        yield served


def _settled(app) -> dict[str, dict]:
    """The model list once the fp32 and int8 models are ready (the fp16 one never is, on a CPU)."""
    return models_when_ready(app, {FP32, INT8})


def test_int8_and_fp32_variants_serve_side_by_side_each_saying_its_precision(app, models_dir, metrics_port):
    models = _settled(app)
    assert (models[FP32]["precision"], models[FP32]["quantized_from"]) == ("fp32", "")
    assert (models[INT8]["precision"], models[INT8]["quantized_from"]) == ("int8", FP32)
    assert models[INT8]["heads"] == models[FP32]["heads"] == 2
    texts = ["a4b9c8d0e1f6:d", "int8 beside fp32"]
    ids, mask = ByteTokenizer(32).encode_batch(texts)
    with app.client() as c:
        for name, precision in ((FP32, "fp32"), (INT8, "int8")):
            out = c.post(f"/v1/models/{name}/predict", json={"texts": texts}).json()
            assert out["config"]["precision"] == precision
            want = bare_logits(models_dir, name, ids, mask)  # ORT on the same file: the int8 graph really ran
            assert np.abs(np.asarray(out["logits"], dtype=np.float32) - want).max() <= 1e-5
            assert c.get(f"/v2/models/{name}").json()["parameters"]["precision"] == precision
    assert np.abs(bare_logits(models_dir, FP32, ids, mask) - bare_logits(models_dir, INT8, ids, mask)).max() > 0

    def precision_by_model(result: list[dict]) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for series in result:
            found.setdefault(series["metric"]["model"], set()).add(series["metric"]["precision"])
        return found

    selector = f'application="{app.name}"'
    with PrometheusServer(f"127.0.0.1:{metrics_port}") as prom:
        for metric in ("ray_mha_requests_total", "ray_mha_batch_size_count"):  # the ingress's and the engine's
            seen = prom.wait_for(
                f"sum by (model, precision) ({metric}{{{selector}}})", lambda r: len(precision_by_model(r)) == 2, 90
            )
            assert precision_by_model(seen) == {FP32: {"fp32"}, INT8: {"int8"}}, metric


def test_an_int8_variant_sends_attention_map_requests_to_its_fp32_source(app):
    _settled(app)
    with app.client() as c:
        response = c.post(f"/v1/models/{INT8}/attention", json={"text": "a4b9"})
    assert response.status_code == 404
    assert f"attention maps come from its fp32 source {FP32!r}" in response.json()["error"]


def test_an_fp16_model_is_refused_on_the_cpu_with_the_fix_named(app):
    models = _settled(app)
    fp16 = models[FP16]
    assert fp16["ready"] is False
    assert "is fp16, which is served on the GPU only" in fp16["error"]
    assert "serve it with backend gpu" in fp16["error"] and f"serve {FP32!r} or its int8 variant" in fp16["error"]
    with app.client() as c:
        refused = c.post(f"/v1/models/{FP16}/predict", json={"text": "hello"})
    assert refused.status_code == 503 and "is fp16" in refused.json()["error"]


@pytest.mark.slow
# The load tester measures the same whichever the placement: one.
@pytest.mark.parametrize("app", ["colocated"], indirect=True)
def test_the_load_tester_compares_precisions_of_one_head_configuration(app, tmp_path):
    _settled(app)
    command = [sys.executable, "-m", "service.cli", "loadtest", "--quiet", "--url", app.base_url]
    command += ["--models", f"{FP32},{INT8}", "--concurrency", "2", "--rate", "", "--duration", "1", "--warmup", "0"]
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    levels = json.loads((tmp_path / "report.json").read_text())["levels"]
    assert sorted((r["model"], r["heads"], r["precision"]) for r in levels) == [(FP32, 2, "fp32"), (INT8, 2, "int8")]
    assert all(r["ok"] > 0 and r["errors"] == {} for r in levels)
