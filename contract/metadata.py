"""The contract between export and serving: a model's head configuration, its name, and its ONNX metadata.

Torch-free on purpose: `service/` reads ONNX files through this module and must never import torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

SCHEMA_VERSION = "1"
TOKENIZER_KINDS = ("byte-v1", "ids")  # "ids": the model takes token ids only, no text
# The numeric precision of a model's weights and arithmetic; inputs (int64) and logits (float32) never change.
PRECISIONS = ("fp32", "int8", "fp16")

# Fixed by the contract (architecture.md): inputs and output by name, dtype and rank.
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"
ATTENTION_WEIGHTS = "attention_weights"  # only in the attention variant of a model
MODEL_FILE = "model.onnx"
ATTENTION_MODEL_FILE = "model.attn.onnx"
CONFIG_FILE = "config.json"
ARCH_KEY = "arch"  # absent or "classifier": ModelMetadata; "decoder": contract/decoder_metadata.py
CLASSIFIER, DECODER = "classifier", "decoder"
TRAINING_FILE = "training.json"  # a trained model's record (export/train.py): its config and validation figures
_OPTIONAL_KEYS = (  # have defaults; others are required
    "tokenizer",
    "ff_dim",
    "task",
    "exporter",
    "attention_kernel",
    "layer_heads",
    "removed_heads",
    "pruned_from",
    "precision",
    "quantized_from",
    "quantization",
)
_JSON_KEYS = ("labels", "exporter", "layer_heads", "removed_heads", "quantization")  # stored as JSON in metadata_props


def identity_problems(name: str, tokenizer: str, precision: str, quantized_from: str) -> list[str]:
    """What is wrong with the keys every model file has, classifier or decoder: its name, tokenizer and precision."""
    problems = []
    if tokenizer not in TOKENIZER_KINDS:
        problems.append(f"tokenizer={tokenizer!r} is not one of {TOKENIZER_KINDS}")
    if not name or "/" in name or name.startswith("."):
        problems.append(f"name={name!r} is not a valid model name")
    if precision not in PRECISIONS:
        problems.append(f"precision={precision!r} is not one of {PRECISIONS}")
    elif (precision == "fp32") == bool(quantized_from):
        problems.append(f"precision={precision!r} with quantized_from={quantized_from!r}")
    return problems


class MetadataError(ValueError):
    """An ONNX file's metadata is missing a key, holds a malformed value, or contradicts itself."""


def config_name(
    heads: int, d_model: int, head_dim: int | None = None, prefix: str = "mha", kv_heads: int | None = None
) -> str:
    """The one spelling of a head configuration's name: folder, Serve deployment and metric label.

    `mha-h8-d512` when head_dim is the default d_model // heads, else `mha-h3-d512-hd64`; with kv_heads (a decoder's
    key/value heads), `lm-h8-kv2-d512`.
    """
    if heads < 1 or d_model < 1:
        raise ValueError(f"heads and d_model must be >= 1, got heads={heads}, d_model={d_model}")
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads != 0):
        raise ValueError(f"kv_heads={kv_heads} must be >= 1 and divide heads={heads}")
    name = f"{prefix}-h{heads}" + (f"-kv{kv_heads}" if kv_heads is not None else "") + f"-d{d_model}"
    if head_dim is not None and head_dim * heads != d_model:
        name += f"-hd{head_dim}"
    return name


@dataclass(frozen=True)
class ModelMetadata:
    """Everything a server needs to know about one exported model, read from the file itself."""

    name: str
    heads: int
    head_dim: int
    d_model: int
    layers: int
    vocab_size: int
    max_len: int
    num_classes: int
    labels: tuple[str, ...]
    tokenizer: str = "byte-v1"
    ff_dim: int = 0  # 0: unknown (a user's own model)
    task: str = ""
    exporter: dict[str, str] = field(default_factory=dict)  # versions: torch, onnx, opset, mha_serving
    attention_kernel: str = ""  # what runs attention in the graph (export/fused_attention.py); "": not recorded
    layer_heads: tuple[int, ...] = ()  # heads per layer when they differ from `heads` (pruned); (): all have `heads`
    removed_heads: tuple[tuple[int, ...], ...] = ()  # per layer, the original indices of the heads pruned away
    pruned_from: str = ""  # the model this one was pruned from; "": not pruned
    precision: str = "fp32"  # one of PRECISIONS
    quantized_from: str = ""  # the fp32 model this int8 or fp16 one was made from; "": none (an fp32 export)
    quantization: dict[str, object] = field(default_factory=dict)  # method, settings and the quality gate's figures

    def __post_init__(self) -> None:
        problems = []
        for key in ("heads", "head_dim", "d_model", "layers", "vocab_size", "max_len", "num_classes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{key}={value!r} must be an integer >= 1")
        if len(self.labels) != self.num_classes:
            problems.append(f"{len(self.labels)} labels for num_classes={self.num_classes}")
        problems += identity_problems(self.name, self.tokenizer, self.precision, self.quantized_from)
        problems += self._pruning_problems()
        if problems:
            raise MetadataError("inconsistent model metadata: " + "; ".join(problems))

    def _pruning_problems(self) -> list[str]:
        if not self.layer_heads and not self.removed_heads:
            return []
        problems = []
        if self.layer_heads and (
            len(self.layer_heads) != self.layers
            or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.layer_heads)
            or max(self.layer_heads) != self.heads
        ):
            problems.append(f"layer_heads={list(self.layer_heads)} must be {self.layers} counts >= 1 with max heads")
        if self.removed_heads and len(self.removed_heads) != self.layers:
            problems.append(f"removed_heads has {len(self.removed_heads)} entries for layers={self.layers}")
        return problems

    @property
    def heads_per_layer(self) -> tuple[int, ...]:
        """The number of heads of each layer (a pruned model's layers may differ)."""
        return tuple(self.layer_heads) if self.layer_heads else (self.heads,) * self.layers

    @property
    def heads_label(self) -> str:
        """`heads` as a metric label: "8", or the per-layer counts "8,6,4,5" when a pruned model's layers differ."""
        per_layer = self.heads_per_layer
        return str(per_layer[0]) if len(set(per_layer)) == 1 else ",".join(map(str, per_layer))

    @property
    def takes_text(self) -> bool:
        """Whether the model tokenizes text with the built-in byte tokenizer ("ids": token ids only)."""
        return self.tokenizer == "byte-v1"

    @property
    def attention_dim(self) -> int:
        """h * head_dim: the width of q, k and v (may differ from d_model when head_dim is explicit)."""
        return self.heads * self.head_dim

    def to_props(self) -> dict[str, str]:
        """As ONNX `metadata_props` (string to string)."""
        props = {"mha_serving.schema": SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "exporter":
                props[f.name] = json.dumps(dict(value), sort_keys=True)
            elif f.name == "quantization":
                props[f.name] = json.dumps(value, sort_keys=True)
            elif f.name in _JSON_KEYS:
                props[f.name] = json.dumps(_lists(value))
            else:
                props[f.name] = str(value)
        return props

    @classmethod
    def from_props(cls, props: dict[str, str]) -> ModelMetadata:
        """Parse and check ONNX `metadata_props`; MetadataError names the first key that is wrong."""
        schema = props.get("mha_serving.schema")
        if schema != SCHEMA_VERSION:
            raise MetadataError(
                f"metadata key 'mha_serving.schema' is {schema!r}, expected {SCHEMA_VERSION!r}: "
                "was this file exported by `mha-serving export`?"
            )
        arch = props.get(ARCH_KEY, CLASSIFIER)
        if arch != CLASSIFIER:
            raise MetadataError(
                f"metadata key {ARCH_KEY!r} is {arch!r}: not a classifier "
                "(contract.decoder_metadata.metadata_from_props reads either kind)"
            )
        values: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in props:
                if f.name in _OPTIONAL_KEYS:
                    continue
                raise MetadataError(f"metadata key {f.name!r} is missing")
            raw = props[f.name]
            try:
                if f.name == "labels":
                    labels = json.loads(raw)
                    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
                        raise ValueError("not a JSON list of strings")
                    values[f.name] = tuple(labels)
                elif f.name == "exporter":
                    values[f.name] = {str(k): str(v) for k, v in json.loads(raw).items()}
                elif f.name == "quantization":
                    record = json.loads(raw)
                    if not isinstance(record, dict):
                        raise ValueError("not a JSON object")
                    values[f.name] = record
                elif f.name == "layer_heads":
                    values[f.name] = _int_tuple(json.loads(raw))
                elif f.name == "removed_heads":
                    values[f.name] = tuple(_int_tuple(layer) for layer in json.loads(raw))
                elif f.type in ("int", int):
                    values[f.name] = int(raw)
                else:
                    values[f.name] = raw
            except (ValueError, AttributeError, TypeError) as exc:
                raise MetadataError(f"metadata key {f.name!r} has a malformed value {raw!r}: {exc}") from exc
        return cls(**values)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, object]:
        """The human-readable form written next to the model as config.json (and served by the API)."""
        out = asdict(self)
        for key in _JSON_KEYS:
            out[key] = _lists(out[key])
        return out


def _lists(value: object) -> object:
    """Tuples (nested) as lists, for JSON."""
    return [_lists(v) for v in value] if isinstance(value, tuple | list) else value


def _int_tuple(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError("not a JSON list of integers")
    return tuple(value)
