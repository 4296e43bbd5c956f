"""What `mha-serving export` is asked to do: flags and config file merged into one checked ExportSettings.

Torch-free: parsing and validation only; a bad value is a UsageError whose message names the key and the value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_HEADS = (1, 2, 4, 8, 16)  # the seed's "typical" set at d_model 512
EXPORT_PRECISIONS = ("fp32", "int8", "fp16")  # contract.metadata.PRECISIONS; fp32 is always exported (the source)
_INT = re.compile(r"[+-]?\d+")


class UsageError(ValueError):
    """A flag or a config file value is wrong (exit status 2)."""


@dataclass(frozen=True)
class ExportSettings:
    out: Path = Path("models")
    heads: tuple[int, ...] = DEFAULT_HEADS
    heads_given: bool = False  # True when --heads (or `heads:` in the config file) was set explicitly
    d_model: int = 512
    head_dim: int | None = None  # None: d_model // h for each h
    layers: int = 4
    ff_dim: int | None = None  # None: 4 * d_model
    max_len: int = 128
    vocab_size: int = 260  # the byte tokenizer's vocabulary (contract/tokenizer.py)
    num_classes: int | None = None  # None: len(labels), else 2
    labels: tuple[str, ...] | None = None  # None: the model config's defaults, or class_0 .. class_{n-1}
    seed: int = 0
    force: bool = False
    attention: bool = False
    atol: float = 1e-4
    model: str | None = None  # package.module:factory (export/user_model.py)
    name_prefix: str | None = None  # None: "mha" for classifiers, "lm" for decoders
    precision: tuple[str, ...] = ("fp32",)  # int8 / fp16 variants made from each fp32 export, behind their gate
    decoder: bool = False  # decoder-only language models with a KV cache instead of classifiers
    kv_heads: int | None = None  # a decoder's key/value heads; None: as many as query heads (MHA)

    @property
    def prefix(self) -> str:
        """The configuration names' prefix: the one given, else `mha` (classifiers) or `lm` (decoders)."""
        return self.name_prefix or ("lm" if self.decoder else "mha")

    def class_labels(self) -> tuple[int, tuple[str, ...] | None]:
        """(num_classes, labels) with the defaults filled in; labels None means "the config's default labels"."""
        if self.labels is not None:
            if self.num_classes is not None and self.num_classes != len(self.labels):
                raise UsageError(f"--num-classes {self.num_classes} does not match {len(self.labels)} --labels")
            return len(self.labels), self.labels
        if self.num_classes is None or self.num_classes == 2:
            return 2, None
        return self.num_classes, tuple(f"class_{i}" for i in range(self.num_classes))


_KEYS = {f.name for f in fields(ExportSettings)} - {"heads_given"}
_INT_KEYS = ("d_model", "head_dim", "layers", "ff_dim", "max_len", "vocab_size", "num_classes", "kv_heads")


def parse_heads(value: object) -> tuple[int, ...]:
    """'1,2,4', [1, 2, 4] or 8 -> (1, 2, 4); UsageError for anything else, h < 1 or duplicates."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    heads = []
    for item in items:
        text = item.strip() if isinstance(item, str) else item
        if isinstance(text, bool) or not (isinstance(text, int) or (isinstance(text, str) and _INT.fullmatch(text))):
            raise UsageError(f"heads must be a comma-separated list of integers such as 1,2,4,8; got {value!r}")
        if int(text) < 1:
            raise UsageError(f"every head count must be >= 1, got h={int(text)} in heads={value!r}")
        heads.append(int(text))
    if not heads:
        raise UsageError("heads is empty: give at least one head count, such as --heads 8")
    if len(set(heads)) != len(heads):
        raise UsageError(f"heads lists a head count twice: {value!r}")
    return tuple(heads)


def parse_precisions(value: object) -> tuple[str, ...]:
    """'fp32,int8' or [fp32, int8] -> ("fp32", "int8"), fp32 first and always there (the variants are made from it)."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else None
    names = [x.strip() for x in items if isinstance(x, str)] if items is not None else []
    if items is None or len(names) != len(items) or not names or any(n not in EXPORT_PRECISIONS for n in names):
        raise UsageError(f"precision must be a comma-separated list of {', '.join(EXPORT_PRECISIONS)}; got {value!r}")
    return ("fp32", *sorted(set(names) - {"fp32"}, key=EXPORT_PRECISIONS.index))


def _parse_labels(value: object) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(x, str) and x.strip() for x in items) or not items:
        raise UsageError(f"labels must be a comma-separated list of names such as negative,positive; got {value!r}")
    labels = tuple(x.strip() for x in items)
    if len(set(labels)) != len(labels):
        raise UsageError(f"labels lists a name twice: {value!r}")
    return labels


def _check_value(key: str, value: object) -> object:
    """One setting from a flag or the config file, converted and range-checked."""
    if key == "heads":
        return parse_heads(value)
    if key == "labels":
        return _parse_labels(value)
    if key == "precision":
        return parse_precisions(value)
    if key in _INT_KEYS or key == "seed":
        if isinstance(value, bool) or not isinstance(value, int) or (key != "seed" and value < 1):
            raise UsageError(f"{key} must be an integer{'' if key == 'seed' else ' >= 1'}, got {value!r}")
        if key == "max_len" and value < 2:
            raise UsageError(f"max_len must be >= 2 (the sequence axis is exported as dynamic), got {value}")
        return value
    if key in ("force", "attention", "decoder"):
        if not isinstance(value, bool):
            raise UsageError(f"{key} must be true or false, got {value!r}")
        return value
    if key == "atol":
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise UsageError(f"atol must be a number >= 0, got {value!r}")
        return float(value)
    if key == "out":
        if not isinstance(value, str | Path) or not str(value):
            raise UsageError(f"out must be a folder path, got {value!r}")
        return Path(value)
    if not isinstance(value, str) or not value:  # model, name_prefix
        raise UsageError(f"{key} must be a non-empty string, got {value!r}")
    return value


def load_config_file(path: Path) -> dict[str, object]:
    """A YAML (.yaml/.yml) or JSON file holding a mapping with the flags' names (dashes or underscores)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    try:
        if Path(path).suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # yaml.YAMLError, json.JSONDecodeError
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(
            f"config file {path} is not valid {Path(path).suffix.lstrip('.') or 'JSON'}: {detail}"
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of settings, not a {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def merge(file_values: dict[str, object], flag_values: dict[str, object], source: str = "") -> ExportSettings:
    """Flags override the config file; every value is checked; unknown keys are named."""
    unknown = sorted(set(file_values) - _KEYS)
    if unknown:
        raise UsageError(f"config file {source}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(_KEYS))}")
    merged = {**{k: v for k, v in file_values.items() if v is not None}, **flag_values}
    values = {key: _check_value(key, value) for key, value in merged.items()}
    return ExportSettings(**values, heads_given="heads" in values)
