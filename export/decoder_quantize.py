"""Precision variants of an exported fp32 decoder: int8 (ONNX Runtime's dynamic quantization of the MatMuls) and fp16,
each written as a sibling folder (`<name>-int8`, `<name>-fp16`) only after a gate against the fp32 decoder: perplexity
on the docs-lm held-out split and greedy-token agreement with the KV cache. Torch-free: both run in ONNX Runtime.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from contract.decoder_metadata import GENAI_CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, DecoderMetadata
from contract.metadata import (
    ATTENTION_MASK,
    CONFIG_FILE,
    INPUT_IDS,
    MODEL_FILE,
    TRAINING_FILE,
)
from contract.tokenizer import VOCAB_SIZE
from export import onnx_file
from export.docs_corpus import CORPUS, DEFAULT_VAL_FRACTION, load_corpus
from export.quantize import (
    VARIANT_PRECISIONS,
    GateError,
    Int8Plan,
    QuantizeError,
    cpu_flags,
    gpu_providers,
    open_session,
    plan_int8,
    read_source,
    to_fp16,
    to_int8,
    variant_name,
)
from export.staging import staged_folder

# Only the MatMuls: ORT's quantizer would turn the ONNX `Attention` node into a com.microsoft QAttention that does not
# take its attributes (an invalid graph). The tied LM head (a MatMul by a transposed table) stays fp32.
INT8_OP_TYPES = ["MatMul"]
NEW_TOKENS = 32  # greedy tokens per prompt in the agreement check
PROMPT_TOKENS = 16  # each prompt: held-out text (fewer when the context cannot hold it and 32 new tokens)
WINDOW = 128  # perplexity: windows of at most this many tokens (the context when shorter), spread over the split
_BATCH = 16  # windows per ORT run
COPIED_FILES = (GENAI_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, TRAINING_FILE)  # checkpoint.pt is fp32's


@dataclass(frozen=True)
class DecoderGateSettings:
    max_perplexity_ratio: float = 1.02  # the variant's held-out perplexity / the fp32 decoder's
    min_token_agreement: float = 0.95  # share of greedy tokens equal to the fp32 decoder's (fed the same tokens)
    tokens: int = 8192  # held-out tokens scored for perplexity (whole windows: rounded down, at least one)
    prompts: int = 8  # prompts for the agreement check, each NEW_TOKENS greedy tokens

    def __post_init__(self) -> None:
        if not self.max_perplexity_ratio > 0:
            raise ValueError(f"max_perplexity_ratio must be > 0, got {self.max_perplexity_ratio}")
        if not 0.0 <= self.min_token_agreement <= 1.0:
            raise ValueError(f"min_token_agreement must be in [0, 1], got {self.min_token_agreement}")
        for key in ("tokens", "prompts"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


@dataclass(frozen=True)
class DecoderGateResult:
    data: str
    tokens: int  # held-out tokens scored
    fp32_perplexity: float
    perplexity: float
    prompts: int
    new_tokens: int  # greedy tokens per prompt
    agreement: float  # share of greedy tokens equal to the fp32 decoder's
    max_logit_diff: float  # over the greedy steps
    device: str  # where the variant ran: "cpu", "gpu"
    gpu_gate: str = ""  # fp16 only: "passed" or "not run: <why>"

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.fp32_perplexity

    def failures(self, settings: DecoderGateSettings) -> list[str]:
        out = []
        if not self.perplexity_ratio <= settings.max_perplexity_ratio:  # NaN fails too
            out.append(
                f"perplexity {self.perplexity:.4f} is {self.perplexity_ratio:.4f} x fp32's {self.fp32_perplexity:.4f} "
                f"(> {settings.max_perplexity_ratio})"
            )
        if self.agreement < settings.min_token_agreement:
            out.append(f"greedy-token agreement {self.agreement:.2%} < {settings.min_token_agreement:.2%}")
        return out

    def summary(self) -> str:
        text = f"perplexity {self.perplexity:.4f} against fp32 {self.fp32_perplexity:.4f} on {self.tokens:,} tokens "
        text += f"({self.data}), greedy-token agreement {self.agreement:.2%} on {self.prompts} prompts x "
        text += f"{self.new_tokens} tokens, max logit diff {self.max_logit_diff:.3g}"
        return text + (f", GPU gate {self.gpu_gate}" if self.gpu_gate else "")


@dataclass(frozen=True)
class DecoderVariantResult:
    name: str
    folder: Path
    precision: str
    meta: DecoderMetadata
    gate: DecoderGateResult
    file_bytes: int
    source_bytes: int
    seconds: float


def decoder_source(folder: Path) -> DecoderMetadata:
    meta = read_source(folder)
    if not isinstance(meta, DecoderMetadata):
        raise QuantizeError(f"{meta.name} is a classifier, not a decoder")
    if meta.tokenizer != "byte-v1" or meta.vocab_size != VOCAB_SIZE:
        raise QuantizeError(
            f"{meta.name}: the gate scores {CORPUS} text in byte-v1 ids; this decoder has tokenizer "
            f"{meta.tokenizer!r} and vocab_size {meta.vocab_size}"
        )
    return meta


def gate_text(meta: DecoderMetadata, settings: DecoderGateSettings) -> tuple[np.ndarray, np.ndarray, str]:
    """Perplexity windows (N, W + 1) and agreement prompts (P, T), both from docs-lm's held-out split."""
    val = np.array(load_corpus(DEFAULT_VAL_FRACTION).val.ids, dtype=np.int64)
    width = min(meta.max_len, WINDOW)
    count = max(1, min(settings.tokens // width, (len(val) - 1) // width))
    starts = np.linspace(0, len(val) - width - 1, count, dtype=np.int64)  # spread over the split, no overlap
    windows = np.stack([val[s : s + width + 1] for s in starts])  # (N, W + 1)
    length = max(1, min(PROMPT_TOKENS, meta.max_len - NEW_TOKENS))
    starts = np.linspace(0, len(val) - length, settings.prompts, dtype=np.int64)  # spread over the whole split
    prompts = np.stack([val[s : s + length] for s in starts])  # (P, T)
    return windows, prompts, f"{CORPUS} held-out split"


def _empty_past(meta: DecoderMetadata, batch: int) -> dict[str, np.ndarray]:
    empty = np.zeros((batch, meta.kv_heads, 0, meta.head_dim), np.float32)
    return {name: empty for name in meta.input_names[3:]}


def _feeds(ids: np.ndarray, total: int) -> dict[str, np.ndarray]:
    """Unpadded rows: new tokens `ids` (B, T) after total - T cached ones."""
    batch, seq = ids.shape
    positions = np.broadcast_to(np.arange(total - seq, total, dtype=np.int64), (batch, seq))  # (B, T)
    return {INPUT_IDS: ids, ATTENTION_MASK: np.ones((batch, total), np.int64), "position_ids": positions}


def perplexity(session: ort.InferenceSession, meta: DecoderMetadata, windows: np.ndarray) -> float:
    """exp of the mean next-token cross-entropy over the windows (N, W + 1), each run from an empty cache."""
    total, count = 0.0, 0
    for start in range(0, len(windows), _BATCH):
        x, y = windows[start : start + _BATCH, :-1], windows[start : start + _BATCH, 1:]  # (B, W) each
        logits = session.run(["logits"], {**_feeds(x, x.shape[1]), **_empty_past(meta, len(x))})[0]  # (B, W, V)
        logits = logits.astype(np.float64)
        peak = logits.max(axis=-1, keepdims=True)
        log_z = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[..., 0]  # (B, W)
        total += float((log_z - np.take_along_axis(logits, y[..., None], axis=-1)[..., 0]).sum())
        count += y.size
    return float(np.exp(total / count))


def greedy_agreement(
    reference: ort.InferenceSession, variant: ort.InferenceSession, meta: DecoderMetadata, prompts: np.ndarray
) -> tuple[float, float]:
    """Greedy in lockstep: both decoders fed the fp32 one's tokens, each with its own cache. The share of steps whose
    greedy token is the fp32 decoder's, and the largest logit difference."""
    names = meta.output_names
    ids, total = prompts, prompts.shape[1]
    pasts = [_empty_past(meta, len(prompts)), _empty_past(meta, len(prompts))]
    same, worst = 0, 0.0
    for _ in range(NEW_TOKENS):
        steps = []
        for i, session in enumerate((reference, variant)):
            out = dict(zip(names, session.run(names, {**_feeds(ids, total), **pasts[i]}), strict=True))
            pasts[i] = {name: out[name.replace("past_key_values", "present")] for name in pasts[i]}
            steps.append(out["logits"][:, -1])  # (B, V)
        expected, got = steps
        worst = max(worst, float(np.abs(expected - got).max()))
        ids = expected.argmax(axis=-1)[:, None]  # (B, 1): the fp32 decoder's tokens, fed to both
        same += int((got.argmax(axis=-1) == ids[:, 0]).sum())
        total += 1
    return same / (NEW_TOKENS * len(prompts)), worst


def _measure(
    source: Path, variant: Path, meta: DecoderMetadata, settings: DecoderGateSettings, providers: list[str]
) -> DecoderGateResult:
    windows, prompts, data = gate_text(meta, settings)
    reference = open_session(source, ["CPUExecutionProvider"])
    session = open_session(variant, providers)
    device = "gpu" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
    agreement, diff = greedy_agreement(reference, session, meta, prompts)
    fp32 = perplexity(reference, meta, windows)
    ppl = perplexity(session, meta, windows)
    return DecoderGateResult(data, windows[:, 1:].size, fp32, ppl, len(prompts), NEW_TOKENS, agreement, diff, device)


def run_gate(
    source: Path, variant: Path, precision: str, meta: DecoderMetadata, settings: DecoderGateSettings
) -> DecoderGateResult:
    """Both decoders on the same text: on the CPU, and for fp16 on the GPU where there is one.

    On the CPU an fp16 graph runs through casts ORT inserts around the kernels it lacks (fp16 Attention among them):
    this checks the conversion, not the GPU's kernels; the GPU gate runs those where a device is present."""
    result = _measure(source, variant, meta, settings, ["CPUExecutionProvider"])
    if precision != "fp16":
        return result
    providers, why_not = gpu_providers()
    if providers is None:
        return replace(result, gpu_gate=f"not run: {why_not}")
    on_gpu = _measure(source, variant, meta, settings, providers)
    if on_gpu.device != "gpu":
        return replace(result, gpu_gate="not run: CUDAExecutionProvider failed to load (CUDA/cuDNN libraries)")
    return replace(on_gpu, gpu_gate="passed")


def make_decoder_variant(
    folder: Path,
    precision: str,
    out_dir: Path | None = None,
    *,
    plan: Int8Plan | None = None,
    gate: DecoderGateSettings | None = None,
) -> DecoderVariantResult:
    """Write `<name>-<precision>` beside `folder` (or in `out_dir`) if the variant passes the gate; GateError if not.

    Staged as the classifiers' variants are: a variant that fails the gate, or an interrupted run, leaves nothing."""
    start = time.perf_counter()
    folder = Path(folder)
    gate = gate or DecoderGateSettings()
    if precision not in VARIANT_PRECISIONS:
        raise ValueError(f"precision must be one of {VARIANT_PRECISIONS}, got {precision!r}")
    meta = decoder_source(folder)
    name = variant_name(meta.name, precision)
    target = Path(out_dir or folder.parent) / name
    with staged_folder(target) as staging:
        path = staging / MODEL_FILE
        if precision == "int8":
            plan = plan or plan_int8(cpu_flags())
            method = to_int8(folder / MODEL_FILE, path, "dynamic", plan, op_types=INT8_OP_TYPES)
        else:
            method = to_fp16(folder / MODEL_FILE, path)  # every input and output keeps its type: the cache is float32
        result = run_gate(folder / MODEL_FILE, path, precision, meta, gate)
        failures = result.failures(gate)
        if failures:
            raise GateError(f"{name} failed the quality gate: {'; '.join(failures)} ({result.summary()}); not written")
        record = {**method, "gate": {k: v for k, v in asdict(result).items() if v != ""}, "gate_settings": asdict(gate)}
        variant_meta = replace(meta, name=name, precision=precision, quantized_from=meta.name, quantization=record)
        onnx_file.save(_sorted(onnx.load(str(path))), variant_meta, path)
        _write_files(folder, staging, variant_meta)
    return DecoderVariantResult(
        name,
        target,
        precision,
        variant_meta,
        result,
        file_bytes=(target / MODEL_FILE).stat().st_size,
        source_bytes=(folder / MODEL_FILE).stat().st_size,
        seconds=time.perf_counter() - start,
    )


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """The nodes in topological order: the fp16 converter puts the casts of the cache's inputs after nodes that read
    them (ONNX Runtime sorts a graph itself; onnx.checker refuses it)."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    OnnxModel(model).topological_sort()
    return model


def _write_files(folder: Path, staging: Path, meta: DecoderMetadata) -> None:
    """config.json (the variant's metadata, the source's parameter count) and the source's other files, as they are:
    genai_config.json names the same file, heads and tensors, and its cache is float32 in every variant."""
    config = json.loads((folder / CONFIG_FILE).read_text()) if (folder / CONFIG_FILE).is_file() else {}
    params = {"params": config["params"]} if "params" in config else {}
    (staging / CONFIG_FILE).write_text(json.dumps({**meta.to_json(), **params}, indent=2) + "\n")
    for file_name in COPIED_FILES:
        if (folder / file_name).is_file():
            shutil.copyfile(folder / file_name, staging / file_name)
