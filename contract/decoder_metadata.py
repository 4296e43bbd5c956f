"""The contract of a decoder (a language model exported with a KV cache): its metadata, its input and output names in
the ONNX Runtime GenAI / Optimum layout, and the files beside it. Torch-free, like contract/metadata.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from contract.metadata import (
    ARCH_KEY,
    ATTENTION_MASK,
    CLASSIFIER,
    DECODER,
    INPUT_IDS,
    LOGITS,
    SCHEMA_VERSION,
    MetadataError,
    ModelMetadata,
    identity_problems,
)

POSITION_IDS = "position_ids"
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"  # %d: the layer (genai_config's spelling)
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
# The attention_kernel of a graph whose cache a server writes in place: every row's tokens from column 0, the mask's
# ones first, `past` and `present` one buffer of the whole context (export/cache_attention.py).
IN_PLACE_KERNEL = "com.microsoft.GroupQueryAttention"
GENAI_CONFIG_FILE = "genai_config.json"  # what onnxruntime-genai reads to load the folder
TOKENIZER_FILE = "tokenizer.json"  # Hugging Face `tokenizers` format
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_INT_KEYS = (
    "heads",
    "kv_heads",
    "head_dim",
    "d_model",
    "layers",
    "vocab_size",
    "max_len",
    "bos_id",
    "eos_id",
    "pad_id",
)
_OPTIONAL_KEYS = (
    "tokenizer",
    "ff_dim",
    "task",
    "exporter",
    "attention_kernel",
    "precision",
    "quantized_from",
    "quantization",
)
_JSON_KEYS = ("exporter", "quantization")  # stored as JSON in metadata_props


@dataclass(frozen=True)
class DecoderMetadata:
    """Everything a server needs to know about one exported decoder, read from the file itself."""

    arch: ClassVar[str] = DECODER
    name: str
    heads: int  # query heads
    kv_heads: int  # key/value heads: heads (MHA), 1 (MQA) or a divisor in between (GQA)
    head_dim: int
    d_model: int
    layers: int
    vocab_size: int
    max_len: int  # context length: prompt and generated tokens together (the position embeddings' size)
    bos_id: int
    eos_id: int
    pad_id: int
    tokenizer: str = "byte-v1"
    ff_dim: int = 0
    task: str = ""  # the corpus it was trained on ("docs-lm"); "": untrained
    exporter: dict[str, str] = field(default_factory=dict)  # versions: torch, onnx, opset, mha_serving
    attention_kernel: str = ""  # what runs attention in the graph; "": not recorded
    precision: str = "fp32"  # one of PRECISIONS
    quantized_from: str = ""  # the fp32 decoder this int8 or fp16 one was made from; "": none (an fp32 export)
    quantization: dict[str, object] = field(default_factory=dict)  # how it was made and its gate's figures

    def __post_init__(self) -> None:
        problems = []
        for key in _INT_KEYS:
            value = getattr(self, key)
            low = 0 if key.endswith("_id") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                problems.append(f"{key}={value!r} must be an integer >= {low}")
        if not problems:
            if self.heads % self.kv_heads != 0:
                problems.append(f"kv_heads={self.kv_heads} does not divide heads={self.heads}")
            for key in ("bos_id", "eos_id", "pad_id"):
                if getattr(self, key) >= self.vocab_size:
                    problems.append(f"{key}={getattr(self, key)} is not below vocab_size={self.vocab_size}")
        problems += identity_problems(self.name, self.tokenizer, self.precision, self.quantized_from)
        if problems:
            raise MetadataError("inconsistent decoder metadata: " + "; ".join(problems))

    @property
    def takes_text(self) -> bool:
        return self.tokenizer == "byte-v1"

    @property
    def heads_label(self) -> str:
        return str(self.heads)

    @property
    def attention_dim(self) -> int:
        """h * head_dim: the width of q (k and v are kv_heads * head_dim wide)."""
        return self.heads * self.head_dim

    @property
    def cache_in_place(self) -> bool:
        """Whether the graph takes its cache left-aligned and can write it in place (else right-aligned, left-padded,
        and concatenated by the graph)."""
        return self.attention_kernel == IN_PLACE_KERNEL

    @property
    def kv_bytes_per_token(self) -> int:
        """What one cached token costs in float32: 2 (key, value) x layers x kv_heads x head_dim x 4 bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4

    @property
    def input_names(self) -> list[str]:
        """In the graph's order: input_ids, attention_mask, position_ids, then past key and value per layer."""
        past = [name % i for i in range(self.layers) for name in (PAST_KEY, PAST_VALUE)]
        return [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *past]

    @property
    def output_names(self) -> list[str]:
        """logits, then the present key and value per layer."""
        return [LOGITS, *[name % i for i in range(self.layers) for name in (PRESENT_KEY, PRESENT_VALUE)]]

    def to_props(self) -> dict[str, str]:
        """As ONNX `metadata_props` (string to string), `arch=decoder` included."""
        props = {"mha_serving.schema": SCHEMA_VERSION, ARCH_KEY: self.arch}
        for f in fields(self):
            value = getattr(self, f.name)
            props[f.name] = json.dumps(dict(value), sort_keys=True) if f.name in _JSON_KEYS else str(value)
        return props

    @classmethod
    def from_props(cls, props: dict[str, str]) -> DecoderMetadata:
        """Parse and check ONNX `metadata_props`; MetadataError names the first key that is wrong."""
        _check_schema(props)
        if props.get(ARCH_KEY) != DECODER:
            raise MetadataError(f"metadata key {ARCH_KEY!r} is {props.get(ARCH_KEY)!r}, expected {DECODER!r}")
        values: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in props:
                if f.name in _OPTIONAL_KEYS:
                    continue
                raise MetadataError(f"metadata key {f.name!r} is missing")
            raw = props[f.name]
            try:
                if f.name == "exporter":
                    values[f.name] = {str(k): str(v) for k, v in json.loads(raw).items()}
                elif f.name == "quantization":
                    values[f.name] = dict(json.loads(raw))
                elif f.name in _INT_KEYS or f.name == "ff_dim":
                    values[f.name] = int(raw)
                else:
                    values[f.name] = raw
            except (ValueError, AttributeError, TypeError) as exc:
                raise MetadataError(f"metadata key {f.name!r} has a malformed value {raw!r}: {exc}") from exc
        return cls(**values)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, object]:
        """The human-readable form written next to the model as config.json."""
        return {ARCH_KEY: self.arch, **asdict(self)}


def metadata_from_props(props: dict[str, str]) -> ModelMetadata | DecoderMetadata:
    """Either kind of model file's metadata, by its `arch` key (absent: a classifier, as every file before decoders)."""
    _check_schema(props)
    arch = props.get(ARCH_KEY, CLASSIFIER)
    if arch == CLASSIFIER:
        return ModelMetadata.from_props(props)
    if arch == DECODER:
        return DecoderMetadata.from_props(props)
    raise MetadataError(f"metadata key {ARCH_KEY!r} is {arch!r}, not one of {(CLASSIFIER, DECODER)}")


def _check_schema(props: dict[str, str]) -> None:
    schema = props.get("mha_serving.schema")
    if schema != SCHEMA_VERSION:
        raise MetadataError(
            f"metadata key 'mha_serving.schema' is {schema!r}, expected {SCHEMA_VERSION!r}: "
            "was this file exported by `mha-serving export`?"
        )
