"""Candidates of `mha-serving optimize` (stage 1): heads kept x precision from a trained model, each written through
its gate into a servable folder, measured in ONNX Runtime against the fp32 source (accuracy drop with a paired
bootstrap CI, agreement), pruned ones timed against their parent; candidates.json, resume, the untrained fallback and
the one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import export_tiny_model
from pruning import DEAD_HEAD, train_tiny

from contract.metadata import MODEL_FILE, ModelMetadata
from export.accuracy_drop import bootstrap_ci
from export.candidate_set import (
    CANDIDATES_FILE,
    CandidateError,
    CandidateSet,
    CandidateSettings,
    FractionError,
    PrecisionError,
    Timing,
)
from export.candidates import make_candidates, measurably_faster
from export.candidates_cli import main as candidates_main

FAST = {"timing_repeats": 20, "bootstrap": 500}  # the tiny models' timing and CI: enough to exercise every path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 1-layer, 4-head model trained briefly on kv-compare, head DEAD_HEAD dead, with its checkpoint."""
    return train_tiny(tmp_path_factory.mktemp("trained"), heads=4, layers=1)[1].folder


@pytest.fixture(scope="module")
def made(trained, tmp_path_factory):
    """(CandidateSet, its OUT folder, progress lines) for the default fractions and precisions on the CPU."""
    out, lines = tmp_path_factory.mktemp("optimize"), []
    return make_candidates(trained, out, CandidateSettings(**FAST), lines.append), out, lines


def _files(folder: Path) -> dict[str, int]:
    """Every file under `folder` -> its mtime in ns."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def _served_metadata(folder: Path) -> ModelMetadata:
    """The metadata as the server reads it: ONNX Runtime's view of the file."""
    session = ort.InferenceSession(str(folder / MODEL_FILE), providers=["CPUExecutionProvider"])
    return ModelMetadata.from_props(session.get_modelmeta().custom_metadata_map)


@pytest.mark.slow
def test_each_fraction_and_precision_is_a_servable_folder_named_as_prune_and_quantize_name_them(made, trained):
    result, out, _ = made
    source = trained.name
    want = [source, f"{source}-int8"] + [f"{source}-keep{k}{p}" for k in (3, 2, 1) for p in ("", "-int8")]
    assert [c.name for c in result.candidates] == want
    from service.model_store import find_models

    assert find_models(out / "candidates") == sorted(want)  # candidates.json beside them is no model
    for c in result.candidates:
        meta = _served_metadata(c.folder)
        assert (meta.name, meta.precision, meta.heads_per_layer) == (c.name, c.precision, c.heads_per_layer)
        assert c.heads_fraction == sum(c.heads_per_layer) / 4
    assert [c.parent for c in result.candidates if c.precision == "int8"] == [
        None,
        f"{source}-int8",
        f"{source}-keep3-int8",
        f"{source}-keep2-int8",
    ]


@pytest.mark.slow
def test_candidates_json_round_trips_to_what_make_candidates_returned(made):
    result, out, _ = made
    record = json.loads((out / "candidates" / CANDIDATES_FILE).read_text())
    assert CandidateSet.from_json(record) == result
    assert CandidateSet.from_json(json.loads(json.dumps(result.to_json()))) == result
    assert set(record) == {"source", "settings", "candidates", "notes"}
    assert record["settings"]["fractions"] == [1.0, 0.75, 0.5, 0.25] and record["settings"]["precisions"] == [
        "fp32",
        "int8",
    ]
    first = record["candidates"][0]
    assert set(first["timing_ms"]) == {"batch_1", "batch_32"} and len(first["timing_ms"]["batch_1"]["rounds_ms"]) == 5


@pytest.mark.slow
def test_accuracy_is_measured_in_onnx_runtime_on_the_split_training_validated_on(made, trained):
    from export.checkpoint import load_checkpoint
    from export.importance import run_splits
    from export.train import evaluate

    result, _, _ = made
    checkpoint = load_checkpoint(trained)
    val = run_splits(checkpoint)[1]
    assert result.source.data == "kv-compare validation split" and result.source.val_examples == len(val.labels)
    assert result.source.accuracy == pytest.approx(evaluate(checkpoint.model, val)[1], abs=1.5 / len(val.labels))
    source = result.candidates[0]
    assert (source.accuracy_drop_points, source.drop_ci_points, source.agreement) == (0.0, (0.0, 0.0), 1.0)
    for c in result.candidates:
        lo, hi = c.drop_ci_points
        assert lo <= c.accuracy_drop_points <= hi
        assert c.accuracy == pytest.approx(result.source.accuracy - c.accuracy_drop_points / 100)
    keep3 = next(c for c in result.candidates if c.name.endswith("-keep3"))
    assert keep3.agreement == 1.0 and "within the bound" in keep3.why  # the dead head went first: nothing changed
    assert json.loads((keep3.folder / "pruning.json").read_text())["removed_in_order"] == [[0, DEAD_HEAD]]


@pytest.mark.slow
def test_a_pruned_candidate_is_kept_only_if_measurably_faster_than_its_parent(made):
    result, _, _ = made
    by_name, compared = {c.name: c for c in result.candidates}, []
    for c in result.candidates:
        for timing in c.timing_ms.values():
            assert min(timing.rounds_ms) <= timing.median_ms <= max(timing.rounds_ms)
            assert timing.spread_ms == pytest.approx(max(timing.rounds_ms) - min(timing.rounds_ms))
        if c.parent is None or "within the bound" not in c.why:
            continue
        faster, words = measurably_faster(c.timing_ms, by_name[c.parent].timing_ms)
        assert c.kept is faster and words in c.why
        compared.append(c.name)
    assert f"{result.source.name}-keep3" in compared  # accurate: only speed decides


def test_measurably_faster_means_faster_than_the_run_to_run_spread_at_some_batch_size():
    def timing(median: float, spread: float) -> Timing:
        return Timing(median, spread, (median - spread / 2, median, median + spread / 2))

    parent = {"batch_1": timing(1.0, 0.1), "batch_32": timing(10.0, 0.5)}
    faster, words = measurably_faster({"batch_1": timing(0.95, 0.05), "batch_32": timing(9.0, 0.2)}, parent)
    assert faster and "batch 32 9.000 against 10.000 ms (spread 0.500)" in words
    within_noise = {"batch_1": timing(0.95, 0.02), "batch_32": timing(9.6, 0.1)}
    assert measurably_faster(within_noise, parent)[0] is False
    assert measurably_faster(parent, parent)[0] is False


@pytest.mark.slow
def test_a_candidate_whose_drop_ci_reaches_past_the_bound_is_dropped_saying_so_and_gated_folders_are_reused(
    made, tmp_path
):
    _, out, _ = made
    shutil.copytree(out / "candidates", tmp_path / "candidates")  # copy2: mtimes kept
    before = _files(tmp_path / "candidates")
    lines = []
    strict = make_candidates(
        made[0].source.folder, tmp_path, CandidateSettings(max_drop_points=0.0, **FAST), lines.append
    )
    after = _files(tmp_path / "candidates")
    assert {k: v for k, v in after.items() if k != CANDIDATES_FILE} == {
        k: v for k, v in before.items() if k != CANDIDATES_FILE
    }
    assert after[CANDIDATES_FILE] != before[CANDIDATES_FILE]
    assert sum("written by an earlier run, reused" in line for line in lines) == 7  # all but the copied source
    over = [c for c in strict.candidates if c.drop_ci_points[1] > 0]
    assert over, "no candidate lost any example the source got right: nothing to check"
    for c in over:
        assert not c.kept and "over the bound of 0" in c.why
    assert strict.candidates[0].kept  # the source: drop 0, CI [0, 0]


@pytest.mark.slow
def test_a_rerun_with_the_same_settings_reuses_candidates_json_and_every_folder(made, trained):
    result, out, _ = made
    before, lines = _files(out / "candidates"), []
    again = make_candidates(trained, out, CandidateSettings(**FAST), lines.append)
    assert again == result and _files(out / "candidates") == before
    assert lines == [f"{out / 'candidates' / CANDIDATES_FILE} is complete for this model and these settings: reused"]


def test_the_bootstrap_interval_is_the_same_for_a_seed_contains_the_drop_and_narrows_with_more_examples():
    rng = np.random.default_rng(3)
    source = rng.random(400) < 0.9  # (N,) correct or not
    candidate = source & (rng.random(400) > 0.05)  # loses about 5 % of them
    drop = (source.mean() - candidate.mean()) * 100
    ci = bootstrap_ci(source, candidate, 1000, seed=0)
    assert ci == bootstrap_ci(source, candidate, 1000, seed=0) and ci != bootstrap_ci(source, candidate, 1000, seed=1)
    assert ci[0] <= drop <= ci[1] and ci[0] > 0
    wider = bootstrap_ci(np.tile(source, 4), np.tile(candidate, 4), 1000, seed=0)
    assert wider[1] - wider[0] < 0.7 * (ci[1] - ci[0])
    assert bootstrap_ci(source, source, 100, seed=0) == (0.0, 0.0)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> Path:
    """A tiny model exported by `mha-serving export`'s path: no task, no checkpoint."""
    return export_tiny_model(tmp_path_factory.mktemp("untrained"), heads=2, seed=3).folder


@pytest.mark.slow
def test_an_untrained_model_gets_precision_candidates_judged_on_agreement_with_accuracy_null(untrained, tmp_path):
    folder, lines = untrained, []
    result = make_candidates(folder, tmp_path / "run", CandidateSettings(**FAST), lines.append)
    assert [c.name for c in result.candidates] == [folder.name, f"{folder.name}-int8"]
    assert any("accuracy cannot be measured without validation data" in line for line in lines)
    assert len(result.notes) == 1 and "no pruned candidates" in result.notes[0] and "untrained" in result.notes[0]
    assert result.source.accuracy is None and "generated ids" in result.source.data
    for c in result.candidates:
        assert (c.accuracy, c.accuracy_drop_points, c.drop_ci_points) == (None, None, None)
        assert c.kept is (c.agreement >= 0.99) and "no labels: accuracy unknown" in c.why
    record = json.loads((tmp_path / "run" / "candidates" / CANDIDATES_FILE).read_text())
    assert record["candidates"][1]["accuracy"] is None and CandidateSet.from_json(record) == result


@pytest.mark.parametrize(
    ("settings", "error", "words"),
    [
        ({"fractions": (0.0,)}, FractionError, "within (0, 1]"),
        ({"fractions": (1.0, 1.5)}, FractionError, "within (0, 1]"),
        ({"precisions": ("fp16",)}, PrecisionError, "backend cpu does not serve fp16; choose from fp32, int8"),
        ({"backend": "gpu", "precisions": ("int8",)}, PrecisionError, "backend gpu does not serve int8"),
        ({"backend": "tpu"}, PrecisionError, "unknown backend 'tpu'"),
        ({"max_drop_points": -1}, CandidateError, "max_drop_points >= 0"),
    ],
)
def test_settings_that_cannot_work_are_one_typed_line(settings, error, words):
    with pytest.raises(error) as caught:
        CandidateSettings(**settings)
    assert words in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fractions", "words"),
    [((0.1,), "leave a layer without heads"), ((0.9,), "removes none of 4 heads"), ((0.5, 0.6), "both remove 2")],
)
def test_a_fraction_the_models_heads_cannot_give_is_one_line_and_nothing_is_written(
    trained, tmp_path, fractions, words
):
    with pytest.raises(FractionError) as caught:
        make_candidates(trained, tmp_path, CandidateSettings(fractions=fractions))
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "candidates").exists()


def test_a_folder_without_a_model_is_one_line_naming_it(tmp_path):
    with pytest.raises(CandidateError, match=r"no model\.onnx"):
        make_candidates(tmp_path, tmp_path / "out")


@pytest.mark.slow
def test_the_command_writes_the_candidates_and_prints_each_verdict(untrained, tmp_path, capsys):
    assert candidates_main(["--model", str(untrained), "--out", str(tmp_path), "--repeats", "10"]) == 0
    out = capsys.readouterr().out
    assert f"{untrained.name}-int8: passed the quality gate" in out
    assert sum(line.startswith(("kept ", "dropped ")) for line in out.splitlines()) == 2
    record = json.loads((tmp_path / "candidates" / CANDIDATES_FILE).read_text())
    assert [c.name for c in CandidateSet.from_json(record).candidates] == [untrained.name, f"{untrained.name}-int8"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--keep", "1,half"], "--keep must be comma-separated fractions"),
        (["--precision", "fp16"], "backend cpu does not serve fp16"),
        (["--backend", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_the_commands_bad_input_is_one_line_with_exit_status_2(untrained, tmp_path, capsys, argv, words):
    assert candidates_main(["--model", str(untrained), "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and not (tmp_path / "candidates").exists()


@pytest.mark.slow
def test_the_gpu_backend_makes_fp16_candidates_and_never_times_fp16_on_the_cpu(untrained, tmp_path):
    from export.quantize import gpu_providers

    result = make_candidates(untrained, tmp_path, CandidateSettings(backend="gpu", **FAST))
    source, fp16 = result.candidates
    assert (fp16.name, fp16.precision) == (f"{untrained.name}-fp16", "fp16") and fp16.agreement is not None
    assert set(source.timing_ms) == {"batch_1", "batch_32"}
    if gpu_providers()[0] is None:
        assert fp16.timing_ms == {} and "not timed: fp16 is timed on a GPU" in fp16.why
    else:
        assert set(fp16.timing_ms) == {"batch_1", "batch_32"}
