"""Precision variants of an exported fp32 model: int8 by ONNX Runtime's quantizer, fp16 for the GPU, each written as a
sibling folder (`<name>-int8`, `<name>-fp16`) only after a quality gate against the fp32 model passes.

The gate compares the variant with its fp32 source on the same inputs. A trained model runs on its task's validation
data: accuracy within a tolerance of fp32's, and argmax agreement. Any other model runs on generated inputs: its
largest logit difference against the spread of its fp32 logits (an untrained model's classes are near ties, so a
difference far below the spread still flips some argmaxes: agreement is reported, not gated). Torch-free: both
models run in ONNX Runtime. A decoder's variants and their gate: export/decoder_quantize.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from contract.decoder_metadata import DecoderMetadata
from contract.metadata import CONFIG_FILE, MODEL_FILE, TRAINING_FILE, MetadataError, ModelMetadata
from contract.tokenizer import NUM_SPECIAL, ByteTokenizer
from export import onnx_file
from export.staging import staged_folder
from export.tasks import TASKS

VARIANT_PRECISIONS = ("int8", "fp16")
MODES = ("dynamic", "static")  # int8: weights only ahead of time (activations per run), or activations calibrated
REDUCE_RANGE = ("auto", "on", "off")
WEIGHT_TYPES = ("s8", "u8")
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})  # /proc/cpuinfo flags of int8 dot-product units
GATE_SEED = 7  # generated gate inputs; calibration uses another seed, so static int8 is not gated on what it saw
CALIBRATION_SEED = 11
_BATCH = 64  # rows per ORT run in the gate


class QuantizeError(RuntimeError):
    """The source cannot be turned into a variant: not an fp32 model folder, or the converter failed."""


class GateError(QuantizeError):
    """The variant is further from its fp32 source than the gate allows; nothing was written."""


@dataclass(frozen=True)
class GateSettings:
    max_accuracy_drop: float = 0.5  # points of validation accuracy (trained models)
    min_agreement: float = 0.99  # fraction of inputs whose argmax equals the fp32 model's (trained models)
    max_relative_diff: float = 0.25  # largest logit difference / standard deviation of fp32 logits (other models)
    examples: int = 512  # generated inputs for a model without a task (a task's validation split is used whole)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ValueError(f"min_agreement must be in [0, 1], got {self.min_agreement}")
        if self.max_accuracy_drop < 0:
            raise ValueError(f"max_accuracy_drop must be >= 0 points, got {self.max_accuracy_drop}")
        if self.max_relative_diff <= 0:
            raise ValueError(f"max_relative_diff must be > 0, got {self.max_relative_diff}")
        if self.examples < 1:
            raise ValueError(f"examples must be >= 1, got {self.examples}")


@dataclass(frozen=True)
class Int8Plan:
    """How int8 runs on this CPU: the weights' type and whether they use 7 bits (reduce_range), and why."""

    weights: str  # "s8": u8 activations x s8 weights (VNNI's instruction); "u8": u8 x u8
    reduce_range: bool
    reason: str


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def plan_int8(flags: frozenset[str], reduce_range: str = "auto", weights: str = "s8") -> Int8Plan:
    """The int8 settings for a CPU with `flags`.

    Without VNNI, ORT's u8 x s8 kernels (AVX2 vpmaddubsw) add pairs of products into 16 bits, which can saturate
    with full-range weights; 7-bit weights (reduce_range) cannot. With VNNI the sums are 32-bit and full range is
    exact. u8 x u8 weights never saturate (another kernel) and need no reduced range.
    """
    if reduce_range not in REDUCE_RANGE:
        raise ValueError(f"reduce_range must be one of {REDUCE_RANGE}, got {reduce_range!r}")
    if weights not in WEIGHT_TYPES:
        raise ValueError(f"weights must be one of {WEIGHT_TYPES}, got {weights!r}")
    vnni = sorted(VNNI_FLAGS & flags)
    if reduce_range != "auto":
        return Int8Plan(weights, reduce_range == "on", f"reduce_range {reduce_range} was requested")
    if weights == "u8":
        return Int8Plan(weights, False, "u8 x u8 weights do not saturate: full range")
    if vnni:
        return Int8Plan(weights, False, f"this CPU has {', '.join(vnni)}: u8 x s8 sums are 32-bit, full range")
    return Int8Plan(weights, True, "no VNNI on this CPU: 7-bit weights, so u8 x s8 pair sums cannot saturate 16 bits")


@dataclass(frozen=True)
class GateData:
    ids: np.ndarray  # (N, T) int64
    mask: np.ndarray  # (N, T) int64
    labels: np.ndarray | None  # (N,) int64, the true labels when the data comes from the model's task
    source: str  # where the inputs come from, in words


@dataclass(frozen=True)
class GateResult:
    data: str
    examples: int
    agreement: float  # fraction of inputs whose argmax equals the fp32 model's
    max_logit_diff: float
    logit_spread: float  # standard deviation of the fp32 logits: the scale max_logit_diff is judged against
    device: str  # where the variant ran: "cpu", "gpu"
    fp32_accuracy: float | None = None  # percent, when the data has labels
    accuracy: float | None = None
    gpu_gate: str = ""  # fp16 only: "passed" or "not run: <why>"

    @property
    def relative_diff(self) -> float:
        return self.max_logit_diff / self.logit_spread if self.logit_spread > 0 else float("inf")

    def failures(self, settings: GateSettings) -> list[str]:
        if self.accuracy is None:
            if self.relative_diff <= settings.max_relative_diff:
                return []
            return [
                f"max logit diff {self.max_logit_diff:.3g} is {self.relative_diff:.2f} of the fp32 logits' spread "
                f"{self.logit_spread:.3g} (> {settings.max_relative_diff})"
            ]
        out = []
        if self.agreement < settings.min_agreement:
            out.append(f"argmax agreement {self.agreement:.2%} < {settings.min_agreement:.2%}")
        if self.fp32_accuracy - self.accuracy > settings.max_accuracy_drop:
            out.append(
                f"accuracy {self.accuracy:.2f} % against fp32 {self.fp32_accuracy:.2f} % "
                f"(drop > {settings.max_accuracy_drop} points)"
            )
        return out

    def summary(self) -> str:
        text = f"agreement {self.agreement:.2%} on {self.examples} inputs ({self.data}), max logit diff "
        text += f"{self.max_logit_diff:.3g} ({self.relative_diff:.2f} of the spread)"
        if self.accuracy is not None:
            text += f", accuracy {self.accuracy:.2f} % (fp32 {self.fp32_accuracy:.2f} %)"
        return text + (f", GPU gate {self.gpu_gate}" if self.gpu_gate else "")


@dataclass(frozen=True)
class VariantResult:
    name: str
    folder: Path
    precision: str
    meta: ModelMetadata
    gate: GateResult
    file_bytes: int
    source_bytes: int
    seconds: float


def variant_name(source: str, precision: str) -> str:
    return f"{source}-{precision}"


def read_source(folder: Path) -> ModelMetadata | DecoderMetadata:
    """The metadata of the fp32 model (classifier or decoder) in `folder`; QuantizeError when it is not one."""
    path = Path(folder) / MODEL_FILE
    if not path.is_file():
        raise QuantizeError(f"{folder}: no {MODEL_FILE} (export a model first: `mha-serving export`)")
    try:
        meta = onnx_file.read_any_metadata(path)
    except MetadataError as exc:
        raise QuantizeError(f"{folder}: {exc}") from exc
    if meta.precision != "fp32":
        raise QuantizeError(
            f"{meta.name} is already {meta.precision}: make variants from its fp32 source {meta.quantized_from!r}"
        )
    return meta


def source_metadata(folder: Path) -> ModelMetadata:
    """The metadata of the fp32 classifier in `folder`; QuantizeError when it is not one."""
    meta = read_source(folder)
    if not isinstance(meta, ModelMetadata):
        raise QuantizeError(f"{meta.name} is a decoder, not a classifier")
    return meta


def gate_data(folder: Path, meta: ModelMetadata, settings: GateSettings, seed: int = GATE_SEED) -> GateData:
    """A trained model's task validation split (training.json's, else fresh task examples); random ids otherwise."""
    task = TASKS.get(meta.task)
    if task is not None and tuple(task.labels) == tuple(meta.labels):
        record = Path(folder) / TRAINING_FILE
        if seed == GATE_SEED and record.is_file():
            config = json.loads(record.read_text())["config"]
            n, val = int(config["examples"]), int(int(config["examples"]) * float(config["val_fraction"]))
            examples = task.generate(n, int(config["seed"]))[n - val :]  # the split export/train.py validates on
            source = f"{task.name} validation split"
        else:
            examples = task.generate(max(settings.examples, 2000), seed)
            source = f"{task.name}, generated examples (seed {seed})"
        ids, mask = ByteTokenizer(meta.max_len).encode_batch([e.text for e in examples])
        labels = np.array([e.label for e in examples], dtype=np.int64)
        return GateData(np.array(ids, dtype=np.int64), np.array(mask, dtype=np.int64), labels, source)
    rng = np.random.default_rng(seed)
    n, width = settings.examples, meta.max_len
    low = NUM_SPECIAL if meta.vocab_size > NUM_SPECIAL else 0
    lengths = rng.integers(1, width + 1, n)
    ids = rng.integers(low, meta.vocab_size, (n, width), dtype=np.int64)  # (N, T)
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)  # (N, T): 1 on the first length tokens
    return GateData(ids * mask, mask, None, f"generated ids, lengths 1..{width} (seed {seed})")


def open_session(path: Path, providers: list[str]) -> ort.InferenceSession:
    """An ORT session that logs errors only (the gate's output stays readable)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=providers)


def feeds(data: GateData) -> Iterator[dict[str, np.ndarray]]:
    """ORT feeds of `data` in batches of _BATCH rows, each trimmed to its longest row (as the server pads)."""
    for start in range(0, len(data.ids), _BATCH):
        mask = data.mask[start : start + _BATCH]  # (b, T)
        width = max(1, int(mask.sum(axis=1).max()))
        yield {"input_ids": data.ids[start : start + _BATCH, :width], "attention_mask": mask[:, :width]}


def logits_of(session: ort.InferenceSession, data: GateData) -> np.ndarray:
    """(N, C) float32 logits of every row of `data`."""
    return np.concatenate([session.run(["logits"], feed)[0] for feed in feeds(data)])  # (N, C)


def compare(reference: np.ndarray, variant: np.ndarray, data: GateData, device: str) -> GateResult:
    """The gate's figures for a variant's logits against the fp32 model's on the same inputs."""
    agree = float(np.mean(reference.argmax(axis=1) == variant.argmax(axis=1)))
    diff = float(np.abs(reference - variant).max())
    result = GateResult(data.source, len(reference), agree, diff, float(reference.std()), device)
    if data.labels is None:
        return result
    fp32_acc = float(np.mean(reference.argmax(axis=1) == data.labels)) * 100
    acc = float(np.mean(variant.argmax(axis=1) == data.labels)) * 100
    return replace(result, fp32_accuracy=round(fp32_acc, 4), accuracy=round(acc, 4))


class _Calibration:
    """ORT's CalibrationDataReader protocol over generated (or task) inputs, in batches."""

    def __init__(self, data: GateData) -> None:
        self._feeds = feeds(data)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


@contextlib.contextmanager
def _converting(src: Path, precision: str):
    """Around ONNX Runtime's converters: their advice on the root logger and the tensors they print while
    calibrating are silenced; any error they raise (from onnx, numpy, their own asserts) is a QuantizeError
    naming the model."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    except Exception as exc:
        raise QuantizeError(f"{src.parent.name}: {precision} conversion failed: {type(exc).__name__}: {exc}") from exc
    finally:
        root.setLevel(level)


def to_int8(
    src: Path,
    dst: Path,
    mode: str,
    plan: Int8Plan,
    calibration: GateData | None = None,
    op_types: list[str] | None = None,
) -> dict[str, object]:
    """Quantize `src` into `dst` with ONNX Runtime's quantizer (`op_types`: only those operators; None: every one it
    knows); returns the method as recorded in the metadata."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    weight_type = QuantType.QInt8 if plan.weights == "s8" else QuantType.QUInt8
    method = {"tool": f"onnxruntime.quantization {ort.__version__}", "mode": mode, "weights": plan.weights}
    method.update(reduce_range=plan.reduce_range, why=plan.reason)
    if op_types is not None:
        method["op_types"] = list(op_types)
    if mode == "dynamic":
        with _converting(src, "int8"):
            quantize_dynamic(
                src,
                dst,
                weight_type=weight_type,
                reduce_range=plan.reduce_range,
                op_types_to_quantize=op_types,
                # a MatMul after a contrib node (the decoder's GroupQueryAttention) has no type from onnx's inference
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
    elif mode == "static":
        if calibration is None:
            raise ValueError("static quantization needs calibration data")
        with _converting(src, "int8"):
            quantize_static(
                src,
                dst,
                _Calibration(calibration),
                quant_format=QuantFormat.QOperator,
                activation_type=QuantType.QUInt8,
                weight_type=weight_type,
                reduce_range=plan.reduce_range,
            )
        method["calibration"] = f"{len(calibration.ids)} inputs: {calibration.source}"
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return method


def to_fp16(src: Path, dst: Path) -> dict[str, object]:
    """fp16 weights and arithmetic; the inputs (int64) and the logits (float32) keep their types."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with _converting(src, "fp16"):
        model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
        onnx.save_model(model, str(dst))
    return {"tool": f"onnxruntime.transformers.float16 {ort.__version__}", "keep_io_types": True}


def gpu_providers() -> tuple[list[str] | None, str]:
    """ORT's providers for a GPU gate, or None and why it cannot run here."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return None, f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)"
    if not Path("/dev/nvidia0").exists():
        return None, "no GPU visible (no /dev/nvidia0)"
    return ["CUDAExecutionProvider", "CPUExecutionProvider"], ""


def run_gate(source: Path, variant: Path, precision: str, data: GateData) -> GateResult:
    """Both models on the same inputs: on the CPU, and for fp16 also on the GPU where there is one."""
    reference = logits_of(open_session(source, ["CPUExecutionProvider"]), data)
    # On the CPU an fp16 graph runs through casts ORT inserts around kernels it lacks: this checks the conversion
    # (fp16 weights and intermediate values), not the GPU's kernels, which the GPU gate runs where a device is present.
    result = compare(reference, logits_of(open_session(variant, ["CPUExecutionProvider"]), data), data, "cpu")
    if precision != "fp16":
        return result
    providers, why_not = gpu_providers()
    if providers is None:
        return replace(result, gpu_gate=f"not run: {why_not}")
    session = open_session(variant, providers)
    if session.get_providers()[0] != "CUDAExecutionProvider":
        return replace(result, gpu_gate="not run: CUDAExecutionProvider failed to load (CUDA/cuDNN libraries)")
    on_gpu = compare(reference, logits_of(session, data), data, "gpu")
    return replace(on_gpu, gpu_gate="passed")


def make_variant(
    folder: Path,
    precision: str,
    out_dir: Path | None = None,
    *,
    mode: str = "dynamic",
    plan: Int8Plan | None = None,
    gate: GateSettings | None = None,
) -> VariantResult:
    """Write `<name>-<precision>` beside `folder` (or in `out_dir`) if the variant passes the gate; GateError if not.

    The folder is built in a staging folder and moved into place only after the gate, so a variant that fails it,
    or an interrupted run, leaves nothing behind (and an existing variant stays as it was).
    """
    start = time.perf_counter()
    folder = Path(folder)
    gate = gate or GateSettings()
    if precision not in VARIANT_PRECISIONS:
        raise ValueError(f"precision must be one of {VARIANT_PRECISIONS}, got {precision!r}")
    meta = source_metadata(folder)
    name = variant_name(meta.name, precision)
    target = Path(out_dir or folder.parent) / name
    data = gate_data(folder, meta, gate)
    with staged_folder(target) as staging:
        path = staging / MODEL_FILE
        if precision == "int8":
            plan = plan or plan_int8(cpu_flags())
            calibration = gate_data(folder, meta, gate, seed=CALIBRATION_SEED) if mode == "static" else None
            method = to_int8(folder / MODEL_FILE, path, mode, plan, calibration)
        else:
            method = to_fp16(folder / MODEL_FILE, path)
        result = run_gate(folder / MODEL_FILE, path, precision, data)
        failures = result.failures(gate)
        if failures:
            raise GateError(f"{name} failed the quality gate: {'; '.join(failures)} ({result.summary()}); not written")
        record = {**method, "gate": {k: v for k, v in asdict(result).items() if v not in (None, "")}}
        record["gate_settings"] = asdict(gate)
        variant_meta = replace(meta, name=name, precision=precision, quantized_from=meta.name, quantization=record)
        onnx_file.save(onnx.load(str(path)), variant_meta, path)
        config = json.loads((folder / CONFIG_FILE).read_text()) if (folder / CONFIG_FILE).is_file() else {}
        params = {"params": config["params"]} if "params" in config else {}
        (staging / CONFIG_FILE).write_text(json.dumps({**variant_meta.to_json(), **params}, indent=2) + "\n")
        if (folder / TRAINING_FILE).is_file():  # how the weights were trained: the same record
            shutil.copyfile(folder / TRAINING_FILE, staging / TRAINING_FILE)
    return VariantResult(
        name,
        target,
        precision,
        variant_meta,
        result,
        file_bytes=(target / MODEL_FILE).stat().st_size,
        source_bytes=(folder / MODEL_FILE).stat().st_size,
        seconds=time.perf_counter() - start,
    )
