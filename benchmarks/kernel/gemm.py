"""The GEMM peaks the kernel benchmark sets its figures against: torch.matmul and ONNX Runtime's fp32 MatMul and
int8 MatMulInteger on single-node graphs, measured in the same run, call by call in turn."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType

from benchmarks.kernel.timing import SETTLE_S
from export.quantize import Int8Plan
from service.runtime import session_options

GEMM_SHAPES = ((2048, 2048, 2048), (4096, 512, 2048), (4096, 2048, 512))  # (M, K, N): square, and the model's MLP


PEAK_REPEATS = 5  # timed calls per GEMM shape and precision; a peak is the best call


INT8_ZERO_POINT = 128  # the u8 activations' zero point, as dynamic quantization feeds MatMulInteger one
FULL_RANGE_S8 = Int8Plan("s8", False, "full-range s8 weights")  # VNNI's plan; the GEMM's speed ignores the values


@dataclass(frozen=True)
class Peaks:
    """The GEMM peaks of one run, measured interleaved on the same threads; 2*M*N*K operations per call."""

    fp32_gflops: float  # torch.matmul, fp32: the bar's reference
    int8_gops: float  # ORT MatMulInteger, u8 activations x the plan's weights, int32 out
    # ORT MatMul, fp32: the library the graphs run in. Torch's GEMM (MKL) can be far slower (half of ORT's on an AMD
    # EPYC), so this is the reference that says what int8 gains over fp32 within ORT.
    fp32_ort_gflops: float = float("nan")

    @property
    def int8_over_fp32(self) -> float:
        return self.int8_gops / self.fp32_gflops

    @property
    def int8_over_fp32_ort(self) -> float:
        return self.int8_gops / self.fp32_ort_gflops


def _gemm_model(op: str, a_type: int, y_type: int, m: int, k: int, n: int, constants: dict) -> onnx.ModelProto:
    """One `op` node: input "a" (M, K) times the constant "b" (K, N) (and any other constants), output "y" (M, N).

    The weights are an initializer, as in an exported model, so ORT may pack them once at session start."""
    graph = helper.make_graph(
        [helper.make_node(op, ["a", *constants], ["y"])],
        f"{op}_peak",
        [helper.make_tensor_value_info("a", a_type, [m, k])],
        [helper.make_tensor_value_info("y", y_type, [m, n])],
        initializer=[numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def matmul_integer_model(
    m: int, k: int, n: int, weights: str = "s8", reduce_range: bool = False, seed: int = 0
) -> onnx.ModelProto:
    """One MatMulInteger node: a (M, K) u8 input with a zero point, times constant (K, N) weights, (M, N) int32 out.
    The weights span the range ORT's quantizer gives them under the same plan (7 bits with `reduce_range`)."""
    types = {"s8": (TensorProto.INT8, np.int8), "u8": (TensorProto.UINT8, np.uint8)}
    if weights not in types:
        raise ValueError(f"weights must be 's8' or 'u8', got {weights!r}")
    onnx_type, dtype = types[weights]
    low, high = get_qmin_qmax_for_qType(onnx_type, reduce_range=reduce_range)
    b = np.random.default_rng(seed).integers(int(low), int(high), size=(k, n), dtype=dtype, endpoint=True)  # (K, N)
    constants = {"b": b, "a_zero_point": np.array(INT8_ZERO_POINT, dtype=np.uint8)}
    return _gemm_model("MatMulInteger", TensorProto.UINT8, TensorProto.INT32, m, k, n, constants)


def matmul_model(m: int, k: int, n: int, seed: int = 0) -> onnx.ModelProto:
    """One fp32 MatMul node: a (M, K) input times constant (K, N) weights, (M, N) out."""
    b = np.random.default_rng(seed).standard_normal((k, n), dtype=np.float32)  # (K, N)
    return _gemm_model("MatMul", TensorProto.FLOAT, TensorProto.FLOAT, m, k, n, {"b": b})


@dataclass(frozen=True)
class BoundGemm:
    """A call of a single-node GEMM graph on `a`, writing into `y`: session.run would copy the result every call.
    It holds `a` and `y`, since ORT's binding only points at their memory."""

    session: ort.InferenceSession
    binding: ort.IOBinding
    a: np.ndarray
    y: np.ndarray

    @classmethod
    def of(cls, model: onnx.ModelProto, a: np.ndarray, y: np.ndarray, threads: int) -> BoundGemm:
        options = session_options(threads)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        binding = session.io_binding()
        binding.bind_cpu_input("a", a)
        binding.bind_output("y", "cpu", 0, y.dtype, list(y.shape), y.ctypes.data)
        return cls(session, binding, a, y)

    def __call__(self) -> None:
        self.session.run_with_iobinding(self.binding)


def gemm_peaks(
    threads: int,
    plan: Int8Plan = FULL_RANGE_S8,
    shapes: tuple[tuple[int, int, int], ...] = GEMM_SHAPES,
    repeats: int = PEAK_REPEATS,
    settle_s: float = SETTLE_S,
) -> Peaks:
    """The best GFLOP/s (GOP/s) of torch.matmul, ORT's fp32 MatMul and ORT's MatMulInteger on `shapes`, `threads`
    threads each, measured now (best call). The three take turns call by call, so that all see the same drift; each
    call follows a pause, so that none pays for the last one's still-spinning threads."""
    torch.set_num_threads(threads)
    best = {"torch": 0.0, "ort-fp32": 0.0, "ort-int8": 0.0}
    with torch.inference_mode():
        for m, k, n in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)  # (M, K), (K, N)
            a8 = np.random.default_rng(seed=1).integers(0, 256, size=(m, k), dtype=np.uint8)  # (M, K)
            int8 = matmul_integer_model(m, k, n, plan.weights, plan.reduce_range)
            calls = {
                "torch": lambda a=a, b=b: a @ b,
                "ort-fp32": BoundGemm.of(matmul_model(m, k, n), a.numpy(), np.empty((m, n), np.float32), threads),
                "ort-int8": BoundGemm.of(int8, a8, np.empty((m, n), np.int32), threads),
            }
            for call in calls.values():
                call()  # warm-up
            for _ in range(repeats):
                for name, call in calls.items():
                    time.sleep(settle_s)
                    start = time.perf_counter()
                    call()
                    best[name] = max(best[name], 2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return Peaks(best["torch"], best["ort-int8"], best["ort-fp32"])
