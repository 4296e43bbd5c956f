"""How to export a decoder: DecoderLM -> one ONNX graph with a KV cache (prefill with past length 0, and decode), in
the ONNX Runtime GenAI / Optimum layout, plus genai_config.json and the tokenizer files; written only after the
generation parity gate (export/decoder_parity.py)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import onnx
import torch

from contract.decoder_metadata import (
    GENAI_CONFIG_FILE,
    IN_PLACE_KERNEL,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    PRESENT_KEY,
    PRESENT_VALUE,
    DecoderMetadata,
)
from contract.metadata import ATTENTION_MASK, CONFIG_FILE, INPUT_IDS, LOGITS, MODEL_FILE
from export import cache_attention, decoder_parity, onnx_file
from export.convert import ExportError, ExportResult, one_line, quiet_torch
from export.decoder import DecoderLM, FlatCache, positions_from_mask
from export.staging import move_into_place
from export.tokenizer_files import tokenizer_files

# Opset 23: torch's exporter writes each scaled_dot_product_attention as one ONNX `Attention` node, which ONNX Runtime
# runs as one CPU kernel (docs/benchmarks.md#decoder-attention-kernel); opset 20 writes MatMul, Softmax, MatMul.
DECODER_OPSET = 23
PLAIN_OPSET = 20
ONNX_ATTENTION, PLAIN_ATTENTION = "onnx.Attention", "unfused"  # the metadata's attention_kernel
TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 2, 8, 4  # traced shapes; the gate runs others (past 0 among them)
# Names of the dynamic axes, as Optimum writes them.
BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"


def _trace_inputs(meta: DecoderMetadata) -> tuple:
    seq = max(2, min(TRACE_SEQ, meta.max_len - TRACE_PAST))
    ids = torch.randint(4, meta.vocab_size, (TRACE_BATCH, seq), dtype=torch.int64)  # (B, T)
    mask = torch.ones(TRACE_BATCH, TRACE_PAST + seq, dtype=torch.int64)  # (B, P+T)
    positions = positions_from_mask(mask)[:, TRACE_PAST:]  # (B, T)
    shape = (TRACE_BATCH, meta.kv_heads, TRACE_PAST, meta.head_dim)
    past = tuple(torch.randn(shape) for _ in range(2 * meta.layers))  # (B, kv, P, hs) each
    return ids, mask, positions, past


def _to_onnx(model: DecoderLM, meta: DecoderMetadata, path: Path, opset: int, in_place: bool) -> None:
    """`in_place`: each layer's cached attention as ORT's GroupQueryAttention where it takes the model's head_dim
    (export/cache_attention.py); else as torch writes it."""
    auto = torch.export.Dim.AUTO  # torch.export finds total = past + seq itself; the axes are renamed afterwards
    shapes = (
        {0: auto, 1: auto},
        {0: auto, 1: auto},
        {0: auto, 1: auto},
        tuple({0: auto, 2: auto} for _ in range(2 * meta.layers)),
    )
    kernels = cache_attention.in_place_layers(model) if in_place else contextlib.nullcontext()
    try:
        with quiet_torch(), torch.no_grad(), kernels:
            program = torch.onnx.export(
                FlatCache(model.eval()),
                _trace_inputs(meta),
                dynamo=True,
                input_names=meta.input_names,
                output_names=meta.output_names,
                dynamic_shapes=shapes,
                opset_version=opset,
                optimize=True,
                verbose=False,
                custom_translation_table=cache_attention.translation_table(),
            )
            if program is None:
                raise ExportError("torch.onnx.export returned nothing")
            program.save(str(path))
    except Exception as exc:
        raise ExportError(f"torch.onnx.export failed for {meta.name}: {one_line(exc)}") from exc


def _axes(meta: DecoderMetadata) -> dict[str, list[str | int]]:
    """Each input's and output's shape, by name, with named dynamic axes."""
    cache_in = [BATCH, meta.kv_heads, PAST, meta.head_dim]
    cache_out = [BATCH, meta.kv_heads, TOTAL, meta.head_dim]
    axes: dict[str, list[str | int]] = {
        INPUT_IDS: [BATCH, SEQ],
        ATTENTION_MASK: [BATCH, TOTAL],
        POSITION_IDS: [BATCH, SEQ],
    }
    axes[LOGITS] = [BATCH, SEQ, meta.vocab_size]
    for i in range(meta.layers):
        axes.update({PAST_KEY % i: cache_in, PAST_VALUE % i: cache_in})
        axes.update({PRESENT_KEY % i: cache_out, PRESENT_VALUE % i: cache_out})
    return axes


def _finish(path: Path, meta: DecoderMetadata, opset: int) -> DecoderMetadata:
    """Check the graph's inputs and outputs, name its dynamic axes, write `meta` into it; return that metadata."""
    model = onnx.load(str(path))
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    if inputs != meta.input_names or outputs != meta.output_names:
        raise ExportError(
            f"{meta.name} does not follow the decoder contract: inputs {inputs} (want {meta.input_names}), "
            f"outputs {outputs} (want {meta.output_names})"
        )
    axes = _axes(meta)
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        for dim, want in zip(dims, axes[value.name], strict=True):
            if isinstance(want, str):
                dim.dim_param = want
            elif dim.dim_value != want:
                raise ExportError(f"{meta.name}: {value.name} has {dim} where the contract wants {want}")
    del model.graph.value_info[:]  # the exporter's symbols (s10, s70...) for inner tensors: ORT infers them again
    exporter = {**meta.exporter, "opset": str(opset)} if meta.exporter else {}  # not the classifiers' opset
    meta = replace(meta, attention_kernel=_kernel(model), exporter=exporter)
    try:
        onnx_file.save(model, meta, path)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"onnx.checker rejected {path.name}: {one_line(exc)}") from exc
    return meta


def _kernel(model: onnx.ModelProto) -> str:
    """What runs attention in the graph: ORT's GroupQueryAttention, ONNX's Attention, or separate nodes."""
    kinds = {f"{node.domain}.{node.op_type}" for node in model.graph.node}
    if IN_PLACE_KERNEL in kinds:
        return IN_PLACE_KERNEL
    return ONNX_ATTENTION if kinds & {".Attention", "ai.onnx.Attention"} else PLAIN_ATTENTION


def genai_config(meta: DecoderMetadata) -> dict[str, object]:
    """genai_config.json: what onnxruntime-genai needs to load the folder as it is (a generic "decoder" model)."""
    return {
        "model": {
            "type": "decoder",
            "bos_token_id": meta.bos_id,
            "eos_token_id": meta.eos_id,
            "pad_token_id": meta.pad_id,
            "vocab_size": meta.vocab_size,
            "context_length": meta.max_len,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": meta.head_dim,
                "hidden_size": meta.d_model,
                "num_attention_heads": meta.heads,
                "num_key_value_heads": meta.kv_heads,
                "num_hidden_layers": meta.layers,
                "inputs": {
                    "input_ids": INPUT_IDS,
                    "attention_mask": ATTENTION_MASK,
                    "position_ids": POSITION_IDS,
                    "past_key_names": PAST_KEY,
                    "past_value_names": PAST_VALUE,
                },
                "outputs": {"logits": LOGITS, "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE},
            },
        },
        "search": {
            "do_sample": False,  # greedy by default
            "num_beams": 1,
            "num_return_sequences": 1,
            "max_length": meta.max_len,
            "min_length": 0,
            "early_stopping": True,
            "length_penalty": 1.0,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "diversity_penalty": 0.0,
            "no_repeat_ngram_size": 0,
            # one buffer of the whole context as past and present, where the graph writes its cache in place
            "past_present_share_buffer": meta.cache_in_place,
        },
    }


def export_decoder(
    model: DecoderLM,
    meta: DecoderMetadata,
    out_dir: Path,
    *,
    atol: float = decoder_parity.DEFAULT_ATOL,
    overwrite: bool = True,
    fuse_attention: bool = True,
    in_place: bool = True,
    extras: dict[str, bytes] | None = None,
) -> ExportResult:
    """Export `model` to `out_dir/<meta.name>/`: model.onnx, config.json, genai_config.json, tokenizer.json and
    tokenizer_config.json (byte-v1 only), and `extras` (file name -> contents). Staged beside the target and moved
    into place only after the generation parity gate passes. `in_place`: the cache's attention as ORT's
    GroupQueryAttention where it takes the head_dim, so a server writes the cache in place (else ONNX's Attention over
    a concatenated cache); `fuse_attention=False`: opset 20, attention unfused."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    target = out_dir / meta.name
    if target.exists() and not overwrite:
        raise ExportError(f"{target} exists; pass overwrite=True (or --force) to replace it")
    decoder_parity.check_context(meta)  # before any work: a context too short for the gate is a usage error
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{meta.name}.", dir=out_dir))
        staging.chmod(0o755)
    except OSError as exc:
        raise ExportError(f"cannot write to output folder {out_dir}: {exc.strerror or exc}") from exc
    try:
        model = model.eval()
        opset = DECODER_OPSET if fuse_attention else PLAIN_OPSET
        _to_onnx(model, meta, staging / MODEL_FILE, opset, in_place and fuse_attention)
        meta = _finish(staging / MODEL_FILE, meta, opset)
        report = decoder_parity.check(model, staging / MODEL_FILE, meta, atol=atol)
        params = model.num_parameters()
        config = {**meta.to_json(), "params": params, "parity": report.to_json()}
        files = {CONFIG_FILE: config, GENAI_CONFIG_FILE: genai_config(meta)}
        for file_name, contents in files.items():
            (staging / file_name).write_text(json.dumps(contents, indent=2) + "\n")
        written = {**(tokenizer_files(meta.max_len) if meta.takes_text else {}), **(extras or {})}
        for file_name, contents in written.items():
            (staging / file_name).write_bytes(contents)
        move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    file_bytes = sum(f.stat().st_size for f in target.iterdir() if f.name.startswith(MODEL_FILE))
    seconds = time.perf_counter() - start
    return ExportResult(meta.name, target, params, file_bytes, report.max_diff, seconds, meta)  # type: ignore[arg-type]
