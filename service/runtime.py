"""The ONNX Runtime session of one replica: honest provider choice (auto, cpu, gpu), thread settings, `run`.

`gpu` that cannot be honoured raises BackendError saying why; `auto` records why it chose what it chose. No torch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract.metadata import ATTENTION_MASK, INPUT_IDS, LOGITS, ModelMetadata
from service.cuda_wait import set_gpu_wait
from service.errors import BackendError, ModelFileError
from service.model_store import check_contract, model_file, without_paths

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
BACKEND_NAMES = {CPU: "cpu", CUDA: "gpu"}


def gpu_visible() -> tuple[bool, str]:
    """Whether this process can see an NVIDIA GPU, and if not, why not."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False, "CUDA_VISIBLE_DEVICES is empty (Ray gives GPUs only to replicas with num_gpus > 0)"
    if not Path("/dev/nvidia0").exists() and not Path("/dev/dxg").exists():
        return False, "no GPU visible (no /dev/nvidia0 device)"
    return True, "a GPU is visible"


def plan_providers(backend: str) -> tuple[list[str], str]:
    """The providers to ask ORT for, and why; raises BackendError when `gpu` cannot be honoured."""
    if backend == "cpu":
        return [CPU], "backend cpu was requested"
    has_cuda = CUDA in ort.get_available_providers()
    visible, why_not = gpu_visible()
    if backend == "gpu":
        if not has_cuda:
            raise BackendError(
                f"backend gpu: this onnxruntime {ort.__version__} is a CPU-only package "
                f"(providers: {ort.get_available_providers()}); install onnxruntime-gpu instead of onnxruntime"
            )
        if not visible:
            raise BackendError(f"backend gpu: {why_not}")
        return [CUDA, CPU], "backend gpu was requested"
    if backend != "auto":
        raise BackendError(f"unknown backend {backend!r}; choose auto, cpu or gpu")
    if not has_cuda:
        return [CPU], "auto chose CPU: onnxruntime has no CUDAExecutionProvider (CPU-only package)"
    if not visible:
        return [CPU], f"auto chose CPU: {why_not}"
    return [CUDA, CPU], "auto chose GPU: CUDAExecutionProvider is installed and a GPU is visible"


SPINNING = ("off", "run", "always")  # what ORT's intra-op threads do while they wait for work (ort_spinning)


def session_options(threads: int, spinning: str = "always") -> ort.SessionOptions:
    """Intra-op threads for one run at a time. `spinning`: "always" (ORT's default: waiting threads spin, also for a
    while after a run), "run" (they spin only while a run is in progress, and stop when it returns), "off" (they
    sleep, and each parallel section wakes them)."""
    if spinning not in SPINNING:
        raise ValueError(f"spinning must be one of {SPINNING}, got {spinning!r}")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0" if spinning == "off" else "1")
    if spinning == "run":
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # errors only; provider fallbacks are reported by us, with the reason
    return opts


@dataclass(frozen=True)
class Runtime:
    """A loaded, contract-checked model and the provider that is really active."""

    session: ort.InferenceSession
    meta: ModelMetadata
    backend: str  # "cpu" or "gpu": what is active, not what was asked for
    reason: str  # why this backend
    threads: int

    def run(self, ids: np.ndarray, mask: np.ndarray, options: ort.RunOptions | None = None) -> np.ndarray:
        """(B, T) int64 ids and mask -> (B, C) float32 logits; `options.terminate` stops the run between nodes."""
        (logits,) = self.session.run([LOGITS], {INPUT_IDS: ids, ATTENTION_MASK: mask}, options)
        return logits


def fp16_on_cpu(meta: ModelMetadata, reason: str) -> str:
    """Why an fp16 model is refused on the CPU, and the fix."""
    return (
        f"model {meta.name!r} is fp16, which is served on the GPU only (ORT's CPU kernels would convert it back to "
        f"fp32 around every operator: slower than the fp32 model; {reason}): serve it with backend gpu on a machine "
        f"with a GPU, or serve {meta.quantized_from!r} or its int8 variant on the CPU"
    )


def preload_cuda_libraries() -> None:
    """Load CUDA/cuDNN from the nvidia-* pip packages (`onnxruntime-gpu[cuda,cudnn]`) if they are installed.

    Without this, ORT finds only system-wide CUDA libraries and silently falls back to CPU; failures here are not
    fatal: the provider check after the session is created reports what really happened.
    """
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is not None:
        with contextlib.suppress(Exception):  # best effort; the active-provider check after loading is the judge
            preload()


def load_runtime(
    models_dir: str | Path, name: str, backend: str, threads: int, spinning: str = "always", gpu_wait: str = "auto"
) -> Runtime:
    """Open `models_dir/name/model.onnx` on the requested backend; ModelFileError or BackendError say why not.
    `gpu_wait`: how this process waits for the GPU (service/cuda_wait.py), set before the first CUDA session."""
    providers, reason = plan_providers(backend)
    if providers[0] == CUDA:
        preload_cuda_libraries()
        if gpu_wait != "auto":
            reason = f"{reason}; {set_gpu_wait(gpu_wait)}"
    path = model_file(models_dir, name)
    try:
        session = ort.InferenceSession(str(path), sess_options=session_options(threads, spinning), providers=providers)
    except Exception as exc:  # ORT's load errors (InvalidProtobuf, Fail, ...) derive from Exception only
        why = f"model {name!r}: ONNX Runtime cannot load {path}: {exc}"
        raise ModelFileError(without_paths(why, path.parent)) from exc
    active = session.get_providers()[0]
    if providers[0] == CUDA and active != CUDA:
        active_all = session.get_providers()
        why = f"CUDAExecutionProvider failed to load its CUDA/cuDNN libraries (active providers: {active_all})"
        if backend == "gpu":
            raise BackendError(f"backend gpu: {why}; check that CUDA and cuDNN match onnxruntime-gpu {ort.__version__}")
        reason = f"auto chose CPU: {why}"
    props = dict(session.get_modelmeta().custom_metadata_map)
    meta = check_contract(name, props, session.get_inputs(), session.get_outputs())
    if meta.precision == "fp16" and active != CUDA:  # this model cannot serve here; the others still do
        raise ModelFileError(fp16_on_cpu(meta, reason))
    return Runtime(session, meta, BACKEND_NAMES.get(active, active), reason, threads)
