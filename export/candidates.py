"""`mha-serving optimize`, stage 1, candidates, accuracy first: from a trained model folder, the head configurations
worth measuring under load. Heads kept (importance order) x precision, each written through its gate, each measured
on what is served (its ONNX file in ONNX Runtime) against the fp32 source, each pruned one timed against its parent.
Writes OUT/candidates/: one servable model folder per candidate, and candidates.json.
"""

from __future__ import annotations

import random
import statistics
import string
from collections.abc import Callable
from pathlib import Path

from contract.metadata import MODEL_FILE
from export.accuracy_drop import CONFIDENCE, AccuracyDrop, accuracy_drop
from export.candidate_folders import Made, copy_source, pruned_folders, removals, variant_folders
from export.candidate_set import (
    CANDIDATES_FILE,
    Candidate,
    CandidateError,
    CandidateSet,
    CandidateSettings,
    Source,
    Timing,
    read_complete,
)
from export.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from export.importance import heads_per_layer
from export.quantize import GateData, GateSettings, QuantizeError, gate_data, gpu_providers, logits_of, open_session
from export.quantize import source_metadata as fp32_metadata
from export.sweep import LATENCY_SEED
from export.sweep_timing import BATCHES, in_process_caller, timed_rounds
from export.tasks import TASKS

CANDIDATES_DIR = "candidates"
TIMED_TEXTS = 64  # texts per timed batch: batch 32 takes the first 32
CPU = ["CPUExecutionProvider"]

Progress = Callable[[str], None]


def make_candidates(
    model_dir: Path, out_dir: Path, settings: CandidateSettings | None = None, progress: Progress = lambda line: None
) -> CandidateSet:
    """Write OUT/candidates/ for the model in `model_dir` and return what candidates.json says. A complete
    candidates.json from the same source and settings is returned as it is; folders of an earlier run are reused."""
    settings = settings or CandidateSettings()
    model_dir, out = Path(model_dir).resolve(), Path(out_dir) / CANDIDATES_DIR
    try:
        meta = fp32_metadata(model_dir)
    except QuantizeError as exc:
        raise CandidateError(f"cannot make candidates: {exc}") from None
    previous = read_complete(out, model_dir, settings)
    if previous is not None:
        progress(f"{out / CANDIDATES_FILE} is complete for this model and these settings: reused")
        return previous
    checkpoint, notes = _checkpoint(model_dir, settings)
    for note in notes:
        progress(note)
    fp32 = [copy_source(model_dir, meta, out)]
    written: set[str] = set()
    if checkpoint is not None:
        pruned, written = pruned_folders(checkpoint, settings, out, progress)
        fp32 += pruned
    made = fp32 + variant_folders(fp32, settings, out, written, progress)
    made.sort(key=lambda m: (-m.fraction, settings.precisions.index(m.precision)))
    data = gate_data(model_dir, meta, GateSettings())
    if data.labels is None:
        progress(
            f"{meta.name} has no task: accuracy cannot be measured without validation data; candidates are judged on "
            f"argmax agreement with the fp32 source on {data.source} (>= {settings.min_agreement:.2%})"
        )
    source, drops = _measure(model_dir, meta, made, data, settings, progress)
    timings, not_timed = _time(made, meta, settings, progress)
    candidates = tuple(_judge(made, drops, timings, not_timed, settings))
    result = CandidateSet(source, settings, candidates, tuple(notes))
    path = result.write(out)
    progress(f"{len(result.kept)} of {len(candidates)} candidates kept: {path}")
    return result


def _checkpoint(model_dir: Path, settings: CandidateSettings) -> tuple[Checkpoint | None, list[str]]:
    """The trained model's checkpoint (fractions checked against its heads), or None and why nothing is pruned."""
    try:
        checkpoint = load_checkpoint(model_dir)
    except CheckpointError as exc:
        if len(settings.fractions) == 1:
            return None, []
        return None, [f"no pruned candidates (heads are ranked and removed in torch): {exc}"]
    removals(settings.fractions, heads_per_layer(checkpoint.model))  # FractionError before any work
    return checkpoint, []


def _measure(model_dir, meta, made: list[Made], data: GateData, settings: CandidateSettings, progress: Progress):
    """The source's figures, and each written candidate's against the source's on the same inputs (ORT, CPU)."""
    reference = logits_of(open_session(model_dir / MODEL_FILE, CPU), data)  # (N, C)
    self_drop = accuracy_drop(reference, reference, data.labels, settings.bootstrap, settings.seed)
    source = Source(
        meta.name, model_dir, meta.task, meta.heads_per_layer, self_drop.accuracy, len(reference), data.source
    )
    drops = {}
    for m in made:
        if m.folder is not None:
            logits = logits_of(open_session(m.folder / MODEL_FILE, CPU), data)  # (N, C)
            drops[m.name] = accuracy_drop(reference, logits, data.labels, settings.bootstrap, settings.seed)
            progress(f"{m.name}: {_figures(drops[m.name])}")
    return source, drops


def _figures(drop: AccuracyDrop) -> str:
    text = f"agreement {drop.agreement:.2%}"
    if drop.ci_points is not None:
        lo, hi = drop.ci_points
        text += f", accuracy {drop.accuracy:.4f}, drop {drop.drop_points:+.2f} points ({CONFIDENCE:.0%} CI "
        text += f"{lo:+.2f}..{hi:+.2f})"
    return text


def _timed_texts(meta) -> list[str] | None:
    """Texts of the model's typical length: its task's, else random letters half its max_len long; None when the
    model takes token ids, not text."""
    if meta.task in TASKS:
        return [e.text for e in TASKS[meta.task].generate(TIMED_TEXTS, LATENCY_SEED)]
    if not meta.takes_text:
        return None
    rng = random.Random(LATENCY_SEED)
    return ["".join(rng.choices(string.ascii_lowercase, k=max(1, meta.max_len // 2))) for _ in range(TIMED_TEXTS)]


def _time(made: list[Made], meta, settings: CandidateSettings, progress: Progress):
    """name -> {"batch_1": Timing, "batch_32": Timing}, every written candidate in the same interleaved rounds
    (export/sweep_timing.py), on the GPU for backend gpu where there is one (fp16 never on the CPU: it would time
    ORT's inserted casts); and name -> why one was not timed."""
    texts = _timed_texts(meta)
    gpu, why_no_gpu = gpu_providers() if settings.backend == "gpu" else (None, "backend cpu")
    callers, not_timed = {}, {}
    for m in made:
        if m.folder is None:
            continue
        if texts is None:
            not_timed[m.name] = "not timed: the model takes token ids, not text"
        elif m.precision == "fp16" and gpu is None:
            not_timed[m.name] = f"not timed: fp16 is timed on a GPU ({why_no_gpu})"
        else:
            callers[m.name] = in_process_caller(m.folder, texts, meta.max_len, settings.threads, gpu)
    if not callers:
        return {}, not_timed
    where = "the GPU" if gpu else f"the CPU, {settings.threads} thread(s)"
    progress(f"timing {len(callers)} candidates on {where} at batch {' and '.join(map(str, BATCHES))}, interleaved")
    rounds = timed_rounds(callers, settings.timing_repeats)
    return {name: {f"batch_{b}": _timing(rounds[name, b]) for b in BATCHES} for name in callers}, not_timed


def _timing(rounds: list[list[float]]) -> Timing:
    medians = [statistics.median(calls) * 1e3 for calls in rounds]
    return Timing(statistics.median(medians), max(medians) - min(medians), tuple(medians))


def measurably_faster(timing: dict[str, Timing], parent: dict[str, Timing]) -> tuple[bool, str]:
    """Whether `timing` beats `parent` at some batch size by more than the run-to-run spread of either; in words."""
    faster, words = False, []
    for key in sorted(set(timing) & set(parent)):
        mine, theirs = timing[key], parent[key]
        spread = max(mine.spread_ms, theirs.spread_ms)
        faster |= theirs.median_ms - mine.median_ms > spread
        words.append(
            f"{key.replace('_', ' ')} {mine.median_ms:.3f} against {theirs.median_ms:.3f} ms (spread {spread:.3f})"
        )
    return faster, ", ".join(words)


def _accuracy_verdict(drop: AccuracyDrop, settings: CandidateSettings) -> tuple[bool, str]:
    if drop.ci_points is None:
        ok = drop.agreement >= settings.min_agreement
        sign = ">=" if ok else "<"
        return ok, f"agreement {drop.agreement:.2%} {sign} {settings.min_agreement:.2%} (no labels: accuracy unknown)"
    lo, hi = drop.ci_points
    ok = hi <= settings.max_drop_points
    where = "within" if ok else "over"
    return ok, (
        f"accuracy drop {drop.drop_points:+.2f} points, upper end of its {CONFIDENCE:.0%} CI {hi:+.2f} (lower "
        f"{lo:+.2f}) {where} the bound of {settings.max_drop_points:g}"
    )


def _judge(made: list[Made], drops, timings, not_timed, settings: CandidateSettings):
    """Each candidate's verdict, largest first: accuracy, then (pruned only) speed against its parent, the nearest
    written candidate of the same precision with more heads."""
    total = sum(made[0].heads_per_layer)
    written: dict[str, Made] = {}  # precision -> the latest written candidate of it, as the next one's parent
    for m in made:
        parent = written.get(m.precision) if m.fraction < 1.0 else None
        drop, timing = drops.get(m.name), timings.get(m.name, {})
        if m.folder is None:
            kept, why = False, m.failed
        else:
            kept, why = _accuracy_verdict(drop, settings)
            written[m.precision] = m
        if kept and parent is not None:
            if not timing or parent.name not in timings:
                why += f"; speed not compared: {not_timed.get(m.name) or not_timed.get(parent.name)}"
            else:
                faster, words = measurably_faster(timing, timings[parent.name])
                kept = faster
                why = f"{'faster' if faster else 'not measurably faster'} than {parent.name}: {words}; {why}"
        if m.name in not_timed and not_timed[m.name] not in why:
            why += f"; {not_timed[m.name]}"
        yield Candidate(
            name=m.name,
            folder=m.folder,
            parent=parent.name if parent else None,
            heads_per_layer=m.heads_per_layer,
            heads_fraction=sum(m.heads_per_layer) / total,
            precision=m.precision,
            accuracy=drop.accuracy if drop else None,
            accuracy_drop_points=drop.drop_points if drop else None,
            drop_ci_points=drop.ci_points if drop else None,
            agreement=drop.agreement if drop else None,
            timing_ms=timing,
            kept=kept,
            why=why,
        )
