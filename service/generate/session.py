"""A decoder's ONNX Runtime session: opened with the classifiers' provider choice and session options
(service/runtime.py), its metadata and input/output names checked against contract/decoder_metadata.py. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract.decoder_metadata import DecoderMetadata
from contract.metadata import MetadataError
from service.errors import BackendError, ModelFileError
from service.model_store import model_file, without_paths
from service.runtime import BACKEND_NAMES, CUDA, plan_providers, preload_cuda_libraries, session_options

INT64 = "tensor(int64)"
CACHE_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # the KV cache's dtype, from the graph


@dataclass(frozen=True)
class DecoderRuntime:
    """A loaded, contract-checked decoder and the provider that is really active."""

    session: ort.InferenceSession
    meta: DecoderMetadata
    backend: str  # "cpu" or "gpu": what is active, not what was asked for
    reason: str  # why this backend
    threads: int
    cache_dtype: type[np.generic]  # what the graph's past_key_values inputs take


def check_decoder(name: str, session: ort.InferenceSession) -> tuple[DecoderMetadata, type[np.generic]]:
    """The metadata of a loaded decoder and its cache dtype; ModelFileError names what breaks the contract."""
    props = dict(session.get_modelmeta().custom_metadata_map)
    try:
        meta = DecoderMetadata.from_props(props)
    except MetadataError as exc:
        raise ModelFileError(f"model {name!r}: {exc}") from exc
    if meta.name != name:
        raise ModelFileError(f"model folder {name!r} holds a model whose metadata name is {meta.name!r}")
    inputs, outputs = session.get_inputs(), session.get_outputs()
    problems = []
    if [i.name for i in inputs] != meta.input_names:
        problems.append(f"inputs are {[i.name for i in inputs]}, expected {meta.input_names}")
    if [o.name for o in outputs] != meta.output_names:
        problems.append(f"outputs are {[o.name for o in outputs]}, expected {meta.output_names}")
    if not problems:
        problems += [f"input {i.name!r} is {i.type}, expected int64" for i in inputs[:3] if i.type != INT64]
        cache_types = {i.type for i in inputs[3:]}
        if len(cache_types) != 1 or not cache_types <= CACHE_TYPES.keys():
            problems.append(f"past_key_values inputs are {sorted(cache_types)}, expected one of {list(CACHE_TYPES)}")
    if problems:
        raise ModelFileError(f"decoder {name!r} breaks the input/output contract: " + "; ".join(problems))
    return meta, CACHE_TYPES[inputs[3].type]


def load_decoder(
    models_dir: str | Path, name: str, backend: str = "auto", threads: int = 1, spinning: str = "run"
) -> DecoderRuntime:
    """Open `models_dir/name/model.onnx`; ModelFileError or BackendError say why not (as service/runtime.py's
    load_runtime does for classifiers)."""
    providers, reason = plan_providers(backend)
    if providers[0] == CUDA:
        preload_cuda_libraries()
    path = model_file(models_dir, name)
    options = session_options(threads, spinning)
    # Without ORT's CPU arena: it keeps its peak for good and rounds chunks up, so the process would hold more than
    # the KV budget's bytes (the cache's arrays are ORT's outputs); plain allocations go back to the C heap, which is
    # trimmed once the engine is quiet (service/heap.py).
    options.enable_cpu_mem_arena = False
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:  # ORT's load errors (InvalidProtobuf, Fail, ...) derive from Exception only
        why = f"model {name!r}: ONNX Runtime cannot load {path}: {exc}"
        raise ModelFileError(without_paths(why, path.parent)) from exc
    active = session.get_providers()[0]
    if providers[0] == CUDA and active != CUDA:
        why = f"CUDAExecutionProvider failed to load (active providers: {session.get_providers()})"
        if backend == "gpu":
            raise BackendError(f"backend gpu: {why}; check that CUDA and cuDNN match onnxruntime-gpu {ort.__version__}")
        reason = f"auto chose CPU: {why}"
    meta, cache_dtype = check_decoder(name, session)
    if cache_dtype is np.float16 and active != CUDA:
        raise ModelFileError(f"decoder {name!r} is fp16, which is served on the GPU only ({reason})")
    return DecoderRuntime(session, meta, BACKEND_NAMES.get(active, active), reason, threads, cache_dtype)
