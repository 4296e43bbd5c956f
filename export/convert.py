"""How to export: torch module -> ONNX file with metadata, written only after it passes the parity gate."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
import torch
from torch import nn

from contract.metadata import (
    ATTENTION_MASK,
    ATTENTION_MODEL_FILE,
    ATTENTION_WEIGHTS,
    CONFIG_FILE,
    INPUT_IDS,
    LOGITS,
    MODEL_FILE,
    ModelMetadata,
)
from export import fused_attention, onnx_file, parity
from export.staging import move_into_place

DEFAULT_ONNX_OPSET = 20
TRACE_BATCH, TRACE_SEQ = 2, 8  # traced shape (seq capped at max_len); the gate checks other shapes
_NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript")  # progress, torchvision


class ExportError(RuntimeError):
    """The exporter failed, or the model does not follow the input/output contract."""


@dataclass(frozen=True)
class ExportResult:
    name: str
    folder: Path
    params: int
    file_bytes: int
    max_diff: float
    seconds: float
    metadata: ModelMetadata


def exporter_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("mha-serving")
    except PackageNotFoundError:  # run from a source tree that is not pip-installed
        ours = "source"
    return {"torch": torch.__version__, "onnx": onnx.__version__, "opset": str(DEFAULT_ONNX_OPSET), "mha_serving": ours}


def one_line(exc: BaseException) -> str:
    """The root cause of an exception chain as `Type: first line`, for one-line CLI errors."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[0] if lines else 'no message'}"


@contextlib.contextmanager
def quiet_torch():
    """Silence the exporter's warnings, log lines ("torchvision is not installed ...") and prints; errors raise."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        quiet_out, quiet_err = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
        with warnings.catch_warnings(), quiet_out, quiet_err:  # torch.export prints failed graphs to stderr
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _to_onnx(module: nn.Module, meta: ModelMetadata, path: Path, output_names: list[str], fuse: bool = False) -> None:
    trace_seq = max(2, min(TRACE_SEQ, meta.max_len))  # 0/1-sized dims would be specialised by torch.export
    batch = torch.export.Dim("batch", min=1, max=65536)
    seq = torch.export.Dim("seq", min=1, max=max(meta.max_len, trace_seq))
    low = min(4, meta.vocab_size - 1)  # past the byte tokenizer's special ids when the vocabulary has them
    ids = torch.randint(low, meta.vocab_size, (TRACE_BATCH, trace_seq), dtype=torch.int64)
    mask = torch.ones(TRACE_BATCH, trace_seq, dtype=torch.int64)
    fused = fused_attention.fused_layers(module) if fuse else contextlib.nullcontext()
    try:
        with quiet_torch(), torch.no_grad(), fused:
            program = torch.onnx.export(
                module,
                (ids, mask),
                dynamo=True,
                input_names=[INPUT_IDS, ATTENTION_MASK],
                output_names=output_names,
                dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),  # positional: any forward argument names
                opset_version=DEFAULT_ONNX_OPSET,
                optimize=True,
                verbose=False,
                custom_translation_table=fused_attention.translation_table() if fuse else None,
            )
            if program is None:
                raise ExportError("torch.onnx.export returned nothing")
            program.save(str(path))
    except Exception as exc:
        raise ExportError(f"torch.onnx.export failed for {meta.name}: {one_line(exc)}") from exc


def _write_metadata(path: Path, meta: ModelMetadata, expected_outputs: list[str]) -> ModelMetadata:
    """Check the file's inputs and outputs, write `meta` with the graph's attention kernel into it; return that."""
    model = onnx.load(str(path))
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    if inputs != [INPUT_IDS, ATTENTION_MASK] or outputs != expected_outputs:
        raise ExportError(
            f"model does not follow the contract: inputs {inputs} (want {[INPUT_IDS, ATTENTION_MASK]}), "
            f"outputs {outputs} (want {expected_outputs})"
        )
    meta = replace(meta, attention_kernel=fused_attention.kernel_of(model))
    try:
        onnx_file.save(model, meta, path)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"onnx.checker rejected {path.name}: {one_line(exc)}") from exc
    return meta


def export_model(
    model: nn.Module,
    meta: ModelMetadata,
    out_dir: Path,
    *,
    attention_variant: nn.Module | None = None,
    atol: float = 1e-4,
    overwrite: bool = True,
    fuse_attention: bool = True,
    extras: dict[str, bytes] | None = None,
) -> ExportResult:
    """Export `model` to `out_dir/<meta.name>/` (model.onnx, config.json; model.attn.onnx with a variant).

    model.onnx runs attention as one fused node per layer (export/fused_attention.py); `fuse_attention=False` exports
    it unfused, as before (the kernel benchmark's baseline). The metadata's attention_kernel says which. `extras`
    (file name -> contents: a training record, a checkpoint) are written into the folder with the rest.

    Everything is built in a temporary folder beside the target and moved into place only after the parity gate
    passes, so a failed export never leaves a half-written model folder behind.
    """
    start = time.perf_counter()
    out_dir = Path(out_dir)
    target = out_dir / meta.name
    if target.exists() and not overwrite:
        raise ExportError(f"{target} exists; pass overwrite=True (or --force) to replace it")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{meta.name}.", dir=out_dir))
        staging.chmod(0o755)  # mkdtemp makes it private; a model folder is meant to be read by a server
    except OSError as exc:
        raise ExportError(f"cannot write to output folder {out_dir}: {exc.strerror or exc}") from exc
    try:
        model = model.eval()
        _to_onnx(model, meta, staging / MODEL_FILE, [LOGITS], fuse=fuse_attention)
        meta = _write_metadata(staging / MODEL_FILE, meta, [LOGITS])
        max_diff = parity.check(model, staging / MODEL_FILE, meta, atol=atol)
        if attention_variant is not None:
            attention_variant = attention_variant.eval()
            _to_onnx(attention_variant, meta, staging / ATTENTION_MODEL_FILE, [LOGITS, ATTENTION_WEIGHTS])
            _write_metadata(staging / ATTENTION_MODEL_FILE, meta, [LOGITS, ATTENTION_WEIGHTS])  # records "unfused"
            max_diff = max(max_diff, parity.check(attention_variant, staging / ATTENTION_MODEL_FILE, meta, atol=atol))
        params = sum(p.numel() for p in model.parameters())
        (staging / CONFIG_FILE).write_text(json.dumps({**meta.to_json(), "params": params}, indent=2) + "\n")
        for file_name, contents in (extras or {}).items():
            (staging / file_name).write_bytes(contents)
        move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    file_bytes = sum(f.stat().st_size for f in target.iterdir() if f.name.startswith(MODEL_FILE))
    return ExportResult(meta.name, target, params, file_bytes, max_diff, time.perf_counter() - start, meta)
