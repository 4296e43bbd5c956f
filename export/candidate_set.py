"""The candidates of `mha-serving optimize`'s first stage as data: their settings, each candidate's figures and
verdict, and candidates.json (written and read back here). Torch-free.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

CANDIDATES_FILE = "candidates.json"
DEFAULT_FRACTIONS = (1.0, 0.75, 0.5, 0.25)
BACKEND_PRECISIONS = {"cpu": ("fp32", "int8"), "gpu": ("fp32", "fp16")}  # what each serving backend runs


class CandidateError(ValueError):
    """Candidates cannot be made: not a model folder, or settings that cannot work (the message names the fix)."""


class FractionError(CandidateError):
    """A fraction of heads kept outside (0, 1], or one that keeps every head or leaves a layer without heads."""


class PrecisionError(CandidateError):
    """A precision that the chosen backend does not serve."""


@dataclass(frozen=True)
class CandidateSettings:
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS  # of all heads kept; 1.0 (the source) is always added
    backend: str = "cpu"
    precisions: tuple[str, ...] = ()  # (): fp32 and the backend's own (int8 on cpu, fp16 on gpu)
    max_drop_points: float = 0.5  # kept only if the upper end of the drop's CI is within this
    min_agreement: float = 0.99  # the bar instead, for a model without labelled data (accuracy unknown)
    seed: int = 0  # the bootstrap's resamples, and fine-tuning's batch order
    bootstrap: int = 1000  # paired resamples of the validation examples
    finetune_steps: int = 0  # AdamW steps after pruning (export/prune.py's finetune)
    finetune_lr: float = 3e-4
    step: int = 1  # heads removed between re-scorings
    timing_repeats: int = 200  # timed calls at batch 1 (batch 32: a quarter), over the timing rounds
    threads: int = 1  # ORT intra-op threads while timing

    def __post_init__(self) -> None:
        bad = [f for f in self.fractions if not 0.0 < f <= 1.0]
        if bad or not self.fractions:
            raise FractionError(f"fractions of heads kept must be within (0, 1], e.g. 1,0.75,0.5; got {bad or '()'}")
        object.__setattr__(self, "fractions", tuple(sorted({1.0, *self.fractions}, reverse=True)))
        if self.backend not in BACKEND_PRECISIONS:
            raise PrecisionError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKEND_PRECISIONS)}")
        served = BACKEND_PRECISIONS[self.backend]
        unknown = [p for p in self.precisions if p not in served]
        if unknown:
            raise PrecisionError(
                f"backend {self.backend} does not serve {', '.join(unknown)}; choose from {', '.join(served)}"
            )
        object.__setattr__(self, "precisions", tuple(p for p in served if p in {"fp32", *(self.precisions or served)}))
        if self.max_drop_points < 0 or not 0.0 <= self.min_agreement <= 1.0:
            raise CandidateError(f"need max_drop_points >= 0 and min_agreement in [0, 1], got {self}")
        if self.bootstrap < 1 or self.step < 1 or self.finetune_steps < 0 or self.finetune_lr <= 0:
            raise CandidateError(f"need bootstrap >= 1, step >= 1, finetune_steps >= 0, finetune_lr > 0; got {self}")
        if self.timing_repeats < 1 or self.threads < 1:
            raise CandidateError(f"need timing_repeats >= 1 and threads >= 1, got {self}")


@dataclass(frozen=True)
class Timing:
    """One batch size's latency: the median of the timing rounds' medians, and their spread (max - min)."""

    median_ms: float
    spread_ms: float
    rounds_ms: tuple[float, ...]


@dataclass(frozen=True)
class Source:
    name: str
    folder: Path
    task: str  # "" when untrained: then accuracy is None and candidates are judged on agreement
    heads_per_layer: tuple[int, ...]
    accuracy: float | None  # fraction correct in ONNX Runtime, on `data`
    val_examples: int  # inputs every candidate is measured on
    data: str  # where they come from, in words


@dataclass(frozen=True)
class Candidate:
    name: str
    folder: Path | None  # None when it was never written (a gate refused it)
    parent: str | None  # the same precision with more heads: what a pruned candidate must be faster than
    heads_per_layer: tuple[int, ...]
    heads_fraction: float  # heads kept / the source's heads
    precision: str
    accuracy: float | None
    accuracy_drop_points: float | None
    drop_ci_points: tuple[float, float] | None
    agreement: float | None
    timing_ms: dict[str, Timing] = field(default_factory=dict)  # "batch_1", "batch_32"
    kept: bool = False
    why: str = ""


@dataclass(frozen=True)
class CandidateSet:
    source: Source
    settings: CandidateSettings
    candidates: tuple[Candidate, ...]
    notes: tuple[str, ...] = ()  # what could not be made and why (e.g. no pruning without a checkpoint)

    @property
    def kept(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.kept)

    def to_json(self) -> dict[str, object]:
        return _plain(asdict(self))

    @classmethod
    def from_json(cls, record: dict) -> CandidateSet:
        source = _build(Source, record["source"])
        settings = _build(CandidateSettings, record["settings"])
        candidates = []
        for item in record["candidates"]:
            timing = {k: _build(Timing, v) for k, v in item["timing_ms"].items()}
            candidates.append(_build(Candidate, {**item, "timing_ms": timing}))
        return cls(source, settings, tuple(candidates), tuple(record.get("notes", ())))

    def write(self, folder: Path) -> Path:
        """candidates.json in `folder`, replaced at once (a reader never sees half of it)."""
        path = Path(folder) / CANDIDATES_FILE
        partial = path.with_name(f".{CANDIDATES_FILE}.partial")
        partial.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(partial, path)
        return path


def read_complete(folder: Path, source_folder: Path, settings: CandidateSettings) -> CandidateSet | None:
    """The candidates.json in `folder` when it was made from the same source with the same settings and every
    folder it names is still there; None otherwise (the stage then runs again)."""
    path = Path(folder) / CANDIDATES_FILE
    try:
        found = CandidateSet.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    same = found.settings == settings and found.source.folder == Path(source_folder).resolve()
    written = all(c.folder is None or c.folder.is_dir() for c in found.candidates)
    return found if same and written else None


def _build(cls, values: dict):
    """A dataclass from JSON values: lists back to tuples, paths back to Path, unknown keys refused."""
    kinds = {f.name: f.type for f in fields(cls)}
    out = {}
    for key, value in values.items():
        if key not in kinds:
            raise KeyError(f"unknown key {key!r} in {cls.__name__}")
        if isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, str) and "Path" in str(kinds[key]):
            value = Path(value)
        out[key] = value
    return cls(**out)


def _plain(value: object) -> object:
    """JSON values: paths as strings, tuples as lists, all the way down."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value
