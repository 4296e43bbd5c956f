"""Reading a model's attention weights: the ONNX attention variant (model.attn.onnx) of a model folder through ONNX
Runtime, per layer and head, for one text. Torch-free: the service and the `attention` command both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.metadata import (
    ATTENTION_MASK,
    ATTENTION_MODEL_FILE,
    ATTENTION_WEIGHTS,
    INPUT_IDS,
    MetadataError,
    ModelMetadata,
)
from contract.tokenizer import ByteTokenizer, SequenceTooLongError


class AttentionMapError(ValueError):
    """A model folder without an attention variant, or a text, layer or head the model cannot take."""


@dataclass(frozen=True)
class AttentionMap:
    meta: ModelMetadata
    tokens: tuple[str, ...]  # one printable label per token ('<bos>', then one per UTF-8 byte)
    layers: tuple[int, ...]  # the layer index of each entry of `weights`
    weights: np.ndarray  # (len(layers), h, T, T) float32: row = query token, column = key token


class AttentionModel:
    """An ONNX Runtime session over a model folder's model.attn.onnx, with the model's metadata."""

    def __init__(self, model_dir: Path, threads: int = 1) -> None:
        import onnxruntime as ort

        model_dir = Path(model_dir)
        path = model_dir / ATTENTION_MODEL_FILE
        if not model_dir.is_dir():
            raise AttentionMapError(f"model folder {model_dir} does not exist")
        if not path.is_file():
            raise AttentionMapError(
                f"{model_dir} has no {ATTENTION_MODEL_FILE}: export the model with its attention variant "
                f"(`mha-serving export --attention ...`, or `mha-serving train`, which writes it by default)"
            )
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        try:
            self.meta = ModelMetadata.from_props(self.session.get_modelmeta().custom_metadata_map)
        except MetadataError as exc:
            raise AttentionMapError(f"{path}: {exc}") from exc
        if ATTENTION_WEIGHTS not in [o.name for o in self.session.get_outputs()]:
            raise AttentionMapError(f"{path} has no output {ATTENTION_WEIGHTS!r}")

    def weights(self, ids: list[int]) -> np.ndarray:
        """Attention weights (layers, h, T, T) for one unpadded row of token ids."""
        feed = {INPUT_IDS: np.array([ids], dtype=np.int64), ATTENTION_MASK: np.ones((1, len(ids)), dtype=np.int64)}
        (weights,) = self.session.run([ATTENTION_WEIGHTS], feed)  # (1, layers, h, T, T)
        return weights[0]

    def attention_map(self, text: str, layer: int | None = None) -> AttentionMap:
        """The weights on `text` for one layer (0-based) or, with layer=None, for every layer."""
        meta = self.meta
        if not meta.takes_text:
            raise AttentionMapError(f"model {meta.name} takes token ids, not text (tokenizer {meta.tokenizer!r})")
        if layer is not None and not 0 <= layer < meta.layers:
            raise AttentionMapError(
                f"layer {layer} is out of range: {meta.name} has {meta.layers} layer(s): 0..{meta.layers - 1}"
            )
        tokenizer = ByteTokenizer(meta.max_len)
        try:
            ids = tokenizer.encode(text)
        except SequenceTooLongError as exc:
            raise AttentionMapError(str(exc)) from exc
        layers = tuple(range(meta.layers)) if layer is None else (layer,)
        weights = self.weights(ids)[list(layers)]  # (len(layers), h, T, T)
        return AttentionMap(meta, tuple(tokenizer.tokens(text)), layers, weights)


def check_head(meta: ModelMetadata, head: int | None) -> None:
    if head is not None and not 0 <= head < meta.heads:
        raise AttentionMapError(
            f"head {head} is out of range: {meta.name} has {meta.heads} head(s): 0..{meta.heads - 1}"
        )
