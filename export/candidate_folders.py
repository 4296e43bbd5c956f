"""The candidates' model folders: the source copied, its heads pruned in importance order (export/prune.py, exported
through the parity gate) and each fp32 model's precision variants (export/quantize.py, through the quality gate).
A folder already written by an earlier run with the same settings is reused, not made again: folders are moved into
place only after their gate, so one that exists passed it.
"""

from __future__ import annotations

import filecmp
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from contract.metadata import MODEL_FILE, MetadataError, ModelMetadata
from export import onnx_file
from export.candidate_set import CandidateSettings, FractionError
from export.checkpoint import Checkpoint
from export.convert import ExportError
from export.importance import heads_per_layer, run_splits
from export.parity import ParityError
from export.prune import PruneError, PruneSettings, heads_to_remove, iterative_prune
from export.prune_cli import PRUNING_FILE, finish_pruned
from export.quantize import QuantizeError, make_variant, variant_name
from export.staging import staged_folder


@dataclass(frozen=True)
class Made:
    """One candidate's folder, or why there is none."""

    name: str
    folder: Path | None
    precision: str
    fraction: float  # the fraction asked for (1.0: the source's heads)
    heads_per_layer: tuple[int, ...]
    failed: str = ""  # why no folder was written (a gate refused it)


def removals(fractions: tuple[float, ...], layer_heads: list[int]) -> dict[float, int]:
    """Each fraction of heads kept below 1 -> how many heads it removes; FractionError names the fix."""
    pruned = [f for f in fractions if f < 1.0]
    try:
        counts = heads_to_remove([round(1.0 - f, 12) for f in pruned], layer_heads)
    except PruneError as exc:  # its words are about fractions dropped: 1 - kept
        kept = ", ".join(f"{f:g}" for f in pruned)
        raise FractionError(f"fractions kept {kept} (dropped: 1 - kept): {exc}") from None
    return dict(zip(pruned, counts.values(), strict=True))


def copy_source(folder: Path, meta: ModelMetadata, out: Path) -> Made:
    """The fp32 source as the first candidate, copied whole (served as it is); kept when an identical copy exists."""
    target = out / meta.name
    if not (target / MODEL_FILE).is_file() or not filecmp.cmp(folder / MODEL_FILE, target / MODEL_FILE, shallow=False):
        with staged_folder(target) as staging:
            shutil.copytree(folder, staging, dirs_exist_ok=True)
    return Made(meta.name, target, "fp32", 1.0, meta.heads_per_layer)


def pruned_folders(
    checkpoint: Checkpoint, settings: CandidateSettings, out: Path, progress: Callable[[str], None]
) -> tuple[list[Made], set[str]]:
    """The fp32 pruned candidates (re-scored after each removal), and the names written in this run."""
    counts = removals(settings.fractions, heads_per_layer(checkpoint.model))
    if not counts:
        return [], set()
    # no model.attn.onnx: candidates are served and timed, not inspected
    how = PruneSettings(
        "importance", settings.seed, settings.step, settings.finetune_steps, settings.finetune_lr, attention=False
    )
    splits = run_splits(checkpoint)
    progress(f"pruning {checkpoint.model.config.name} in importance order: {sorted(set(counts.values()))} head(s)")
    found = iterative_prune(checkpoint.model, splits[1], list(counts.values()), how.order, how.seed, how.step)
    made, written = [], set()
    for fraction, n in counts.items():
        pruned = found[n]
        name, per_layer = pruned.model.config.name, tuple(heads_per_layer(pruned.model))
        if _same_pruning(out / name, how, n):
            progress(f"{name}: written by an earlier run, reused")
            made.append(Made(name, out / name, "fp32", fraction, per_layer))
            continue
        try:
            exported, _ = finish_pruned(how, checkpoint, pruned, round(1.0 - fraction, 12), splits, out)
        except (ExportError, ParityError) as exc:
            made.append(Made(name, None, "fp32", fraction, per_layer, failed=f"export failed: {exc}"))
            continue
        progress(f"{name}: exported ({n} head(s) removed, parity max diff {exported.max_diff:.2g})")
        made.append(Made(name, exported.folder, "fp32", fraction, per_layer))
        written.add(name)
    return made, written


def variant_folders(
    fp32: list[Made], settings: CandidateSettings, out: Path, written: set[str], progress: Callable[[str], None]
) -> list[Made]:
    """Each fp32 candidate's precision variants, past the quantize gate; one whose parent was just (re)written is
    made again."""
    made = []
    for parent in fp32:
        for precision in settings.precisions[1:]:
            name = variant_name(parent.name, precision)
            made.append(_variant(parent, precision, name, out, parent.name in written, progress))
    return made


def _variant(parent: Made, precision: str, name: str, out: Path, fresh_parent: bool, progress) -> Made:
    target = out / name
    if parent.folder is None:
        return Made(name, None, precision, parent.fraction, parent.heads_per_layer, f"no fp32 parent: {parent.failed}")
    if not fresh_parent and _variant_of(target, precision, parent.name):
        progress(f"{name}: written by an earlier run, reused")
        return Made(name, target, precision, parent.fraction, parent.heads_per_layer)
    try:
        result = make_variant(parent.folder, precision, out)
    except QuantizeError as exc:  # GateError included: the variant is not written
        shutil.rmtree(target, ignore_errors=True)  # an earlier run's variant of another parent
        progress(f"{name}: not written: {exc}")
        return Made(name, None, precision, parent.fraction, parent.heads_per_layer, str(exc))
    progress(f"{name}: passed the quality gate ({result.gate.summary()})")
    return Made(name, result.folder, precision, parent.fraction, parent.heads_per_layer)


def _metadata(folder: Path) -> ModelMetadata | None:
    try:
        return onnx_file.read_metadata(folder / MODEL_FILE) if (folder / MODEL_FILE).is_file() else None
    except MetadataError:
        return None


def _same_pruning(folder: Path, how: PruneSettings, removed: int) -> bool:
    """Whether `folder` holds a pruned model made the way `how` says, `removed` heads fewer."""
    meta = _metadata(folder)
    try:
        record = json.loads((folder / PRUNING_FILE).read_text())
    except (OSError, ValueError):
        return False
    wanted = {"order": how.order, "seed": how.seed, "step": how.step, "removed": removed}
    wanted |= {"finetune_steps": how.finetune_steps, "finetune_lr": how.finetune_lr}
    return meta is not None and meta.name == folder.name and all(record.get(k) == v for k, v in wanted.items())


def _variant_of(folder: Path, precision: str, source: str) -> bool:
    meta = _metadata(folder)
    return meta is not None and (meta.name, meta.precision, meta.quantized_from) == (folder.name, precision, source)
