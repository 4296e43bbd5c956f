"""Request rows checked against a model's metadata and the request limits, as (B, T) int64 ids and mask.

Every problem is a BadRequestError that names it (shape, id range, length, rows); the same limits as JSON Schema for
the OpenAPI document (Bounds). Shared by both protocols. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from contract.metadata import ModelMetadata
from contract.tokenizer import ByteTokenizer, SequenceTooLongError
from service.errors import BadRequestError
from service.inference import InferenceRequest
from service.limits import check_row_count

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Schema = dict[str, Any]
MASK_VALUE = {"enum": [0, 1]}  # an attention_mask element: 0 padding, 1 token


@dataclass(frozen=True)
class Rows:
    """A request's input, checked: ids and mask of shape (B, T), int64, mask in {0, 1}, a token in every row."""

    ids: np.ndarray
    mask: np.ndarray


@dataclass(frozen=True)
class Bounds:
    """The limits these checks enforce, as JSON Schema states them for the OpenAPI document. A request body's schema
    cannot depend on the path's model name, so with several models served the bounds are the tightest among them:
    every body valid by the document is accepted by each model, and a model with larger limits accepts more."""

    max_rows: int
    max_len: int | None = None  # None: no served model's metadata known yet (none loaded): left unstated
    vocab_size: int | None = None
    layers: int | None = None
    text: bool = True  # every served model tokenizes text

    @classmethod
    def of(cls, max_rows: int, models: list[ModelMetadata]) -> Bounds:
        if not models:
            return cls(max_rows)
        return cls(
            max_rows,
            max_len=min(m.max_len for m in models),
            vocab_size=min(m.vocab_size for m in models),
            layers=min(m.layers for m in models),
            text=all(m.takes_text for m in models),
        )

    def rows(self, item: Schema) -> Schema:
        """A request's sequences (or texts): 1 to max_rows of `item`."""
        return {"type": "array", "minItems": 1, "maxItems": self.max_rows, "items": item}

    def row(self, token: Schema) -> Schema:
        """One sequence: 1 to max_len tokens."""
        return {"type": "array", "minItems": 1, "items": token} | _at_most("maxItems", self.max_len)

    def flat(self, value: Schema) -> Schema:
        """A [B, T] matrix's values, flat row-major: 1 to max_rows x max_len of `value`."""
        most = self.max_len and self.max_rows * self.max_len
        return {"type": "array", "minItems": 1, "items": value} | _at_most("maxItems", most)

    def shape(self, matrix: bool) -> Schema:
        """A v2 tensor's shape: [B] (texts) or [B, T] (a matrix), each dimension at least 1."""
        dims = [{"type": "integer", "minimum": 1, "maximum": self.max_rows}]
        if matrix:
            dims.append({"type": "integer", "minimum": 1} | _at_most("maximum", self.max_len))
        return {"type": "array", "prefixItems": dims, "minItems": len(dims), "maxItems": len(dims)}

    def token_id(self) -> Schema:
        return {"type": "integer", "minimum": 0} | _at_most("maximum", self.vocab_size and self.vocab_size - 1)

    def text_schema(self) -> Schema:
        """A text: 1 BOS and one token per UTF-8 byte within max_len. JSON Schema's maxLength counts characters, so
        a text of max_len - 1 characters or fewer may still be refused for its bytes (the one limit stated loosely)."""
        return {"type": "string"} | _at_most("maxLength", self.max_len and self.max_len - 1)

    def layer(self) -> Schema:
        return {"type": "integer", "minimum": 0} | _at_most("maximum", self.layers and self.layers - 1)


def _at_most(keyword: str, bound: int | None) -> Schema:
    return {} if bound is None else {keyword: bound}


def int_matrix(name: str, data: object, shape: list[int] | None = None) -> np.ndarray:
    """Nested or flat integer data -> an int64 matrix; `shape` (from a v2 tensor) reshapes flat row-major data."""
    try:
        array = np.asarray(data)
    except ValueError as exc:  # ragged nesting
        raise BadRequestError(f"{name}: data is not a rectangular array ({exc})") from exc
    if array.size and (array.dtype.kind not in "iu" or array.dtype == np.uint64):
        _not_int64(name, data, array)
    if shape is not None:
        if len(shape) != 2 or any(d < 0 for d in shape):
            raise BadRequestError(f"{name}: shape must be [batch, sequence], got {shape}")
        if array.size != shape[0] * shape[1]:
            raise BadRequestError(f"{name}: shape {shape} needs {shape[0] * shape[1]} values, data has {array.size}")
        array = array.reshape(shape)  # flat row-major (or nested) -> (B, T)
    if array.ndim != 2:
        raise BadRequestError(f"{name}: expected a [batch, sequence] matrix, got {array.ndim} dimension(s)")
    return array.astype(np.int64, copy=False)


def _not_int64(name: str, data: object, array: np.ndarray) -> None:
    """BadRequestError for data that is not all int64: the first integer outside its range as sent (numpy turns
    ints past 2**63 into uint64, float or object arrays), else the values' type."""
    values = np.asarray(data, dtype=object).ravel()
    if all(isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in values):
        big = next((int(v) for v in values if not INT64_MIN <= int(v) <= INT64_MAX), None)
        if big is None:
            return
        raise BadRequestError(f"{name}: {big} is outside the int64 range")
    raise BadRequestError(f"{name}: data must be integers, got {array.dtype.name} values")


def check_rows(ids: np.ndarray, mask: np.ndarray | None, meta: ModelMetadata, max_rows: int) -> Rows:
    """Check (B, T) ids (and mask, default all ones) against the model: sizes, max_len, vocabulary, padding."""
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise BadRequestError(f"input_ids is empty (shape {list(ids.shape)}): send at least one token")
    check_row_count(ids.shape[0], max_rows)
    if ids.shape[1] > meta.max_len:
        raise BadRequestError(f"sequence length {ids.shape[1]} is over the model's max_len={meta.max_len}")
    if _unsigned_max(ids) >= meta.vocab_size:  # one pass: a negative id is above every id as unsigned
        low = int(ids.min())
        bad = low if low < 0 else int(ids.max())
        raise BadRequestError(f"token id {bad} is outside the vocabulary [0, {meta.vocab_size - 1}]")
    if mask is None:
        return Rows(ids, np.ones_like(ids))  # every row has a token: T > 0
    if mask.shape != ids.shape:
        raise BadRequestError(f"attention_mask shape {list(mask.shape)} differs from input_ids {list(ids.shape)}")
    if _unsigned_max(mask) > 1:
        raise BadRequestError("attention_mask must hold only 0 (padding) and 1 (token)")
    with_tokens = mask.any(axis=1)  # (B,)
    if not with_tokens.all():
        raise BadRequestError(f"row {int(np.flatnonzero(~with_tokens)[0])} has no tokens (attention_mask is all 0)")
    return Rows(ids, mask)


def _unsigned_max(matrix: np.ndarray) -> int:
    """The largest value of an int64 matrix read as unsigned: negative values count as 2**63 and more. On the
    request path: one reduction instead of a min and a max (or numpy's isin, ten times slower), ~1.4 us."""
    return int(matrix.view(np.uint64).max())


def texts_to_rows(texts: list[str], meta: ModelMetadata, max_rows: int) -> Rows:
    """Tokenize with the model's tokenizer and pad to the longest text."""
    if not meta.takes_text:
        raise BadRequestError(f"model {meta.name!r} takes token ids only (tokenizer {meta.tokenizer!r}), not text")
    if not texts:
        raise BadRequestError("no texts given: send at least one")
    check_row_count(len(texts), max_rows, "texts")
    if not all(isinstance(t, str) for t in texts):
        raise BadRequestError("texts must be strings")
    try:
        ids, mask = ByteTokenizer(meta.max_len).encode_batch(texts)
    except SequenceTooLongError as exc:
        raise BadRequestError(str(exc)) from exc
    return Rows(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64))


def ragged(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token-id rows of different lengths -> padded (B, T) ids and mask (the simple API without attention_mask)."""
    if not rows or not all(isinstance(r, list) for r in rows):
        raise BadRequestError("input_ids must be a non-empty list of token-id lists")
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)  # (B, T), PAD_ID 0
    mask = np.zeros((len(rows), width), dtype=np.int64)  # (B, T)
    for i, row in enumerate(rows):
        if not row:
            raise BadRequestError(f"row {i} of input_ids is empty")
        ids[i, : len(row)] = int_matrix("input_ids", [row])[0]
        mask[i, : len(row)] = 1
    return ids, mask


def rows_of(request: InferenceRequest, meta: ModelMetadata, max_rows: int) -> Rows:
    """A decoded request's rows for this model: its texts tokenized, or its ids and mask checked."""
    if request.texts is not None:
        return texts_to_rows(request.texts, meta, max_rows)
    if request.ids is None:
        raise BadRequestError("the request has neither token ids nor texts")
    return check_rows(request.ids, request.mask, meta, max_rows)
