"""`python -m benchmarks.run_modes`: three ways to call one ONNX Runtime session, timed on one backend, so that the
serving path keeps what measures faster (issue 39: "consider I/O binding and CUDA graphs"):

- `plain`: `session.run` with numpy inputs (ORT copies them to the device and the logits back): what serving does;
- `iobinding`: inputs bound from host memory, logits bound on the device and copied back after the run;
- `cudagraph`: CUDA only: device buffers of one fixed (B, T), the run captured once and replayed (inputs copied in
  place, logits copied back), the least the CPU can do per run.

Per batch size: median ms per run and sequences/s, each mode over the same inputs, in interleaved rounds."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from benchmarks.serving.bare import call_times
from benchmarks.serving.requests import TOKENS
from contract.metadata import ATTENTION_MASK, INPUT_IDS, LOGITS
from service.errors import BackendError
from service.runtime import CUDA, load_runtime, model_file, plan_providers, preload_cuda_libraries, session_options

MODES = ("plain", "iobinding", "cudagraph")


class Bound:
    """Inputs bound from host memory each run, the logits left on the device (`device`) and copied back."""

    def __init__(self, session: ort.InferenceSession, device: str) -> None:
        self.session, self.device = session, device

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        binding = self.session.io_binding()
        binding.bind_cpu_input(INPUT_IDS, ids)
        binding.bind_cpu_input(ATTENTION_MASK, mask)
        binding.bind_output(LOGITS, self.device)
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]


class Graph:
    """A CUDA graph of one (B, T): captured on the first run, replayed on the next; inputs of that shape only."""

    def __init__(self, path: Path, ids: np.ndarray, classes: int, out_dtype) -> None:
        opts = session_options(1)
        providers = [(CUDA, {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
        self.ids = ort.OrtValue.ortvalue_from_numpy(ids, "cuda", 0)  # (B, T) on the device, updated in place
        self.mask = ort.OrtValue.ortvalue_from_numpy(np.ones_like(ids), "cuda", 0)
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type((ids.shape[0], classes), out_dtype, "cuda", 0)
        self.binding = self.session.io_binding()
        self.binding.bind_ortvalue_input(INPUT_IDS, self.ids)
        self.binding.bind_ortvalue_input(ATTENTION_MASK, self.mask)
        self.binding.bind_ortvalue_output(LOGITS, self.logits)
        self.session.run_with_iobinding(self.binding)  # the capture

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self.ids.update_inplace(ids)
        self.mask.update_inplace(mask)
        self.session.run_with_iobinding(self.binding)
        return self.logits.numpy()


def callers(models_dir: Path, name: str, backend: str, batch: int) -> tuple[dict, np.ndarray, np.ndarray, dict]:
    """The modes that can run here for (batch, TOKENS) inputs, the inputs, and why the others cannot."""
    runtime = load_runtime(models_dir, name, backend, threads=1)
    ids = np.random.default_rng(batch).integers(4, 260, size=(batch, TOKENS))  # (B, T)
    mask = np.ones_like(ids)
    reference = runtime.run(ids, mask)  # (B, C)
    device = "cuda" if runtime.backend == "gpu" else "cpu"
    modes, why_not = {"plain": runtime.run, "iobinding": Bound(runtime.session, device)}, {}
    if runtime.backend != "gpu":
        why_not["cudagraph"] = f"ORT runs on {runtime.backend} here ({runtime.reason}): CUDA graphs need the GPU"
    else:
        try:
            path = model_file(models_dir, name)
            modes["cudagraph"] = Graph(path, ids, reference.shape[1], reference.dtype)
        except Exception as exc:  # ORT refuses a graph with nodes off CUDA, or a shape it cannot capture
            why_not["cudagraph"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    for mode, call in list(modes.items()):
        got = call(ids, mask)
        if not np.allclose(got, reference, atol=1e-3, rtol=1e-3):
            why_not[mode] = f"logits differ from plain run's by {float(np.abs(got - reference).max()):.2g}"
            del modes[mode]
    return modes, ids, mask, why_not


def measure(models_dir: Path, names: list[str], backend: str, batches: list[int], seconds: float, rounds: int):
    """name -> batch -> mode -> {p50_ms, seq_s (per round)} or {why_not}."""
    out: dict = {}
    for name in names:
        for batch in batches:
            modes, ids, mask, why_not = callers(models_dir, name, backend, batch)
            row = out.setdefault(name, {}).setdefault(batch, {m: {"why_not": w} for m, w in why_not.items()})
            samples: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(rounds):  # interleaved: the machine's drift falls on every mode alike
                for mode, call in modes.items():
                    samples[mode].extend(call_times(call, ids, mask, seconds / rounds, warmup=5))
            for mode, times in samples.items():
                p50 = float(np.median(times))
                row[mode] = {"p50_ms": p50 * 1e3, "seq_s": batch / p50, "runs": len(times)}
            print(f"{name} B={batch}: " + ", ".join(line(m, row[m]) for m in MODES if m in row), flush=True)
    return out


def line(mode: str, figures: dict) -> str:
    if "why_not" in figures:
        return f"{mode} not run ({figures['why_not']})"
    return f"{mode} {figures['p50_ms']:.3f} ms ({figures['seq_s']:,.0f} seq/s)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_modes", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument("--model", action="append", required=True, help="a model folder in --models (repeatable)")
    p.add_argument("--backend", choices=("cpu", "gpu"), default="gpu")
    p.add_argument("--batches", default="1,8,32,64", help="batch sizes, one sequence of 32 tokens per row")
    p.add_argument("--seconds", type=float, default=1.0, help="per mode per batch size (default: 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--batches: {args.batches!r} is not a list of positive batch sizes")
    for name in args.model:
        if not model_file(args.models, name).is_file():
            p.error(f"--model: no {model_file(args.models, name)}")
    try:
        providers, reason = plan_providers(args.backend)
    except BackendError as exc:
        p.error(str(exc))
    if providers[0] == CUDA:
        preload_cuda_libraries()
    print(f"onnxruntime {ort.__version__}, backend {args.backend}: {reason}", flush=True)
    found = measure(args.models, args.model, args.backend, batches, args.seconds, args.rounds)
    if args.json:
        args.json.write_text(json.dumps({"ort": ort.__version__, "backend": args.backend, "figures": found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
