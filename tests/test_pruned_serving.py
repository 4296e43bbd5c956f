"""A pruned model served beside its unpruned source, in the session's Ray Serve: listed with its heads per layer,
answering what ONNX Runtime answers, told apart in the metrics by its `heads` label, and load-tested side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus import PrometheusServer
from serving import bare_logits, deployed, models_when_ready

from contract.tokenizer import ByteTokenizer

pytestmark = pytest.mark.serve
ROOT = Path(__file__).resolve().parents[1]
APP = "pruned"
UNPRUNED, PRUNED = "mha-h4-d32", "mha-h4-d32-keep3-1"
KEEP = [[0, 2, 3], [1]]  # heads kept per layer: 3 in layer 0, 1 in layer 1


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """A 2-layer, 4-head model and the same model pruned to 3 and 1 heads, both exported through the normal path."""
    import torch

    from export.convert import export_model
    from export.model import EncoderClassifier, EncoderConfig
    from export.prune import prune_model

    out = tmp_path_factory.mktemp("pruned-models")
    torch.manual_seed(0)
    config = EncoderConfig(heads=4, d_model=32, layers=2, ff_dim=64, max_len=32, task="demo")
    model = EncoderClassifier(config).eval()
    pruned = prune_model(model, KEEP)
    for m in (model, pruned):
        export_model(m, m.config.metadata(), out)
    return out


@pytest.fixture(scope="module", params=["colocated", "deployment"])
def app(request, serve_port, models_dir):
    """Both models served by one application, once per placement (metrics are recorded in different places)."""
    with deployed(serve_port, f"{APP}-{request.param}", models_dir, request.param) as served:
        yield served


def test_pruned_and_unpruned_models_are_listed_answer_like_ort_and_carry_their_heads_label(
    app, models_dir, metrics_port
):
    models = models_when_ready(app, {UNPRUNED, PRUNED})
    assert set(models) == {UNPRUNED, PRUNED} and all(m["ready"] for m in models.values())
    assert models[UNPRUNED]["layer_heads"] == [4, 4] and models[PRUNED]["layer_heads"] == [3, 1]
    assert (models[PRUNED]["heads"], models[PRUNED]["head_dim"]) == (3, 8)  # the widest layer; head_dim unchanged
    texts = ["a4b9c8d0e1f6:d", "which heads matter"]
    ids, mask = ByteTokenizer(32).encode_batch(texts)
    with app.client() as c:
        for name in (UNPRUNED, PRUNED):
            out = c.post(f"/v1/models/{name}/predict", json={"texts": texts}).json()
            assert out["config"]["layer_heads"] == models[name]["layer_heads"]
            want = bare_logits(models_dir, name, ids, mask)
            assert np.abs(np.asarray(out["logits"], dtype=np.float32) - want).max() <= 1e-5

    def heads_by_model(result: list[dict]) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for series in result:
            found.setdefault(series["metric"]["model"], set()).add(series["metric"]["heads"])
        return found

    selector = f'application="{app.name}"'
    with PrometheusServer(f"127.0.0.1:{metrics_port}") as prom:  # a real Prometheus scraping Ray's export
        for metric in ("ray_mha_requests_total", "ray_mha_batch_size_count"):  # ingress's and engine's series
            seen = prom.wait_for(
                f"sum by (model, heads) ({metric}{{{selector}}})", lambda res: len(heads_by_model(res)) == 2, 90
            )
            assert heads_by_model(seen) == {UNPRUNED: {"4"}, PRUNED: {"3,1"}}, metric


@pytest.mark.slow
# The load tester measures the same whichever the placement: one.
@pytest.mark.parametrize("app", ["colocated"], indirect=True)
def test_the_load_tester_compares_the_pruned_model_with_the_unpruned_one(app, tmp_path):
    models_when_ready(app, {UNPRUNED, PRUNED})
    command = [sys.executable, "-m", "service.cli", "loadtest", "--quiet", "--url", app.base_url]
    command += ["--concurrency", "2", "--rate", "", "--duration", "1", "--warmup", "0", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    levels = json.loads((tmp_path / "report.json").read_text())["levels"]
    assert sorted((r["model"], r["heads"]) for r in levels) == [(UNPRUNED, 4), (PRUNED, 3)]
    assert all(r["ok"] > 0 and r["errors"] == {} for r in levels)
    assert all(f"| {name} |" in (tmp_path / "report.md").read_text() for name in (UNPRUNED, PRUNED))
