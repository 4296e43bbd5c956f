"""The KV cache's layout for one decoding step (one new token per row) on CPU, attention only (Q, K, V are graph
inputs, no projections). `concat`: ONNX `Attention` (opset 23) with past_key/past_value, producing present by
concatenation. `concat nodes`: what torch's exporter writes for the decoder today, two Concat nodes, then Attention
over present with a boolean mask. `in place`: the new key and value written into a preallocated buffer of capacity C
by `TensorScatter` (opset 24; the buffer is bound as both its input and its output through I/O binding), then
`Attention` (opset 24) over the whole buffer, each row's valid length given by `nonpad_kv_seqlen` or by a boolean
attn_mask. Each graph holds one independent attention node per layer. Checks that the variants agree, then prints a
Markdown table (median ms per step over interleaved rounds, in place / concat, the largest difference).

    python -m benchmarks.kv_layout [--rounds 5 --threads 2]
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from benchmarks.kernel.timing import time_interleaved

HEADS, HEAD_DIM, LAYERS = 8, 64, 4  # the default decoder's query heads and head size; one node per layer
CONCAT_OPSET, IN_PLACE_OPSET = 23, 24  # TensorScatter and nonpad_kv_seqlen are new in opset 24
LENGTHS = ("nonpad", "mask")  # how in place tells Attention each row's valid length
BATCHES, WINDOWS, KV_HEADS, WHOLE_CONTEXT = (1, 16, 32), (32, 96, 288), (8, 1), 320


@dataclass(frozen=True)
class Case:
    batch: int
    window: int  # W: keys already cached in every row
    capacity: int  # C: the in-place buffer's length, at least W + 1
    kv_heads: int
    layers: int = LAYERS

    def __post_init__(self) -> None:
        if self.capacity < self.window + 1:
            raise ValueError(f"capacity {self.capacity} cannot hold window {self.window} plus the new token")


def cases() -> list[Case]:
    """Each (B, W, kv) with C = W + 1 rounded up to a multiple of 64, and with C = the whole context."""
    out = []
    for batch, window, kv in itertools.product(BATCHES, WINDOWS, KV_HEADS):
        rounded = -(-(window + 1) // 64) * 64
        out += [Case(batch, window, c, kv) for c in sorted({rounded, WHOLE_CONTEXT})]
    return out


def _float(name: str, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _model(nodes, inputs, outputs, initializers, opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "kv_layout", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10  # the newest ORT 1.32 reads
    onnx.checker.check_model(model)
    return model


def concat_model(case: Case, separate: bool = False) -> onnx.ModelProto:
    """Per layer: Attention(q, k, v, past) -> y, present = concat(past, k/v) of shape (B, kv, W + 1, hd). `separate`:
    the shape torch's exporter writes for the decoder instead: present from two Concat nodes, then Attention over
    present with a boolean attn_mask (B, 1, 1, W + 1), all true here (the decoder builds it from attention_mask)."""
    b, kv, w = case.batch, case.kv_heads, case.window
    nodes, inputs, outputs = [], [], []
    if separate:
        inputs.append(helper.make_tensor_value_info("attn_mask", TensorProto.BOOL, [b, 1, 1, w + 1]))
    for i in range(case.layers):
        inputs += [_float(f"q{i}", [b, HEADS, 1, HEAD_DIM])]
        inputs += [_float(f"{t}{i}", [b, kv, 1, HEAD_DIM]) for t in "kv"]
        inputs += [_float(f"past_{t}{i}", [b, kv, w, HEAD_DIM]) for t in "kv"]
        outputs += [_float(f"y{i}", [b, HEADS, 1, HEAD_DIM])]
        outputs += [_float(f"present_{t}{i}", [b, kv, w + 1, HEAD_DIM]) for t in "kv"]
        if separate:
            nodes += [
                helper.make_node("Concat", [f"past_{t}{i}", f"{t}{i}"], [f"present_{t}{i}"], axis=2) for t in "kv"
            ]
            nodes.append(
                helper.make_node("Attention", [f"q{i}", f"present_k{i}", f"present_v{i}", "attn_mask"], [f"y{i}"])
            )
        else:
            nodes.append(
                helper.make_node(
                    "Attention",
                    [f"q{i}", f"k{i}", f"v{i}", "", f"past_k{i}", f"past_v{i}"],
                    [f"y{i}", f"present_k{i}", f"present_v{i}"],
                )
            )
    return _model(nodes, inputs, outputs, [], CONCAT_OPSET)


def in_place_model(case: Case, lengths: str) -> onnx.ModelProto:
    """Per layer: TensorScatter the new k/v into the (B, kv, C, hd) buffer at each row's write_index, then Attention
    over the whole buffer; the valid length (write_index + 1) is computed once per step and shared by the layers."""
    if lengths not in LENGTHS:
        raise ValueError(f"lengths must be one of {LENGTHS}, not {lengths!r}")
    b, kv, c = case.batch, case.kv_heads, case.capacity
    initializers = [helper.make_tensor("one", TensorProto.INT64, [], [1])]
    nodes = [helper.make_node("Add", ["write_index", "one"], ["seqlen"])]  # (B,)
    if lengths == "mask":
        initializers += [
            helper.make_tensor("positions", TensorProto.INT64, [1, 1, 1, c], list(range(c))),
            helper.make_tensor("axes", TensorProto.INT64, [3], [1, 2, 3]),
        ]
        nodes += [
            helper.make_node("Unsqueeze", ["seqlen", "axes"], ["seqlen_4d"]),  # (B, 1, 1, 1)
            helper.make_node("Less", ["positions", "seqlen_4d"], ["mask"]),  # (B, 1, 1, C), True = attend
        ]
    mask, nonpad = ("mask", "") if lengths == "mask" else ("", "seqlen")
    inputs = [helper.make_tensor_value_info("write_index", TensorProto.INT64, [b])]
    outputs = []
    for i in range(case.layers):
        inputs += [_float(f"q{i}", [b, HEADS, 1, HEAD_DIM])]
        inputs += [_float(f"{t}{i}", [b, kv, 1, HEAD_DIM]) for t in "kv"]
        inputs += [_float(f"cache_{t}{i}", [b, kv, c, HEAD_DIM]) for t in "kv"]
        outputs += [_float(f"y{i}", [b, HEADS, 1, HEAD_DIM])]
        outputs += [_float(f"written_{t}{i}", [b, kv, c, HEAD_DIM]) for t in "kv"]
        nodes += [
            helper.make_node("TensorScatter", [f"cache_{t}{i}", f"{t}{i}", "write_index"], [f"written_{t}{i}"], axis=2)
            for t in "kv"
        ]
        nodes.append(
            helper.make_node("Attention", [f"q{i}", f"written_k{i}", f"written_v{i}", mask, "", "", nonpad], [f"y{i}"])
        )
    return _model(nodes, inputs, outputs, initializers, IN_PLACE_OPSET)


@dataclass(frozen=True)
class StepData:
    """One step's random inputs; the in-place buffers hold the same past keys, then garbage past W, so that a layout
    that attends beyond each row's length disagrees."""

    feeds: dict[str, np.ndarray]  # q, k, v per layer
    past: dict[str, np.ndarray]  # past_k{i}, past_v{i}: (B, kv, W, hd)
    buffers: dict[str, np.ndarray]  # cache_k{i}, cache_v{i}: (B, kv, C, hd)
    write_index: np.ndarray  # (B,) = W
    attn_mask: np.ndarray  # (B, 1, 1, W + 1), all true: the separate-Concat graph's mask

    @staticmethod
    def random(case: Case, seed: int = 0) -> StepData:
        rng = np.random.default_rng(seed)
        b, kv, w, c = case.batch, case.kv_heads, case.window, case.capacity
        feeds, past, buffers = {}, {}, {}
        for i in range(case.layers):
            feeds[f"q{i}"] = rng.standard_normal((b, HEADS, 1, HEAD_DIM), np.float32)
            for t in "kv":
                feeds[f"{t}{i}"] = rng.standard_normal((b, kv, 1, HEAD_DIM), np.float32)
                past[f"past_{t}{i}"] = rng.standard_normal((b, kv, w, HEAD_DIM), np.float32)
                buffer = 10 * rng.standard_normal((b, kv, c, HEAD_DIM), np.float32)
                buffer[:, :, :w] = past[f"past_{t}{i}"]
                buffers[f"cache_{t}{i}"] = buffer
        return StepData(feeds, past, buffers, np.full(b, w, np.int64), np.ones((b, 1, 1, w + 1), bool))


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


class BoundStep:
    """A session with its inputs bound once. Concat: ORT allocates present each run, as in the decoding loop. In
    place: each buffer is one OrtValue bound as TensorScatter's input and output, so the step writes into it (ORT
    logs a warning, "in-place optimization not activated", on each run where it copies the buffer instead)."""

    def __init__(self, sess: ort.InferenceSession, data: StepData):
        self.sess, self.binding, self.data = sess, sess.io_binding(), data  # data: bound numpy arrays stay alive
        names = [i.name for i in sess.get_inputs()]
        self.buffers = {n: ort.OrtValue.ortvalue_from_numpy(data.buffers[n].copy()) for n in names if n in data.buffers}
        arrays = {**data.feeds, **data.past, "write_index": data.write_index, "attn_mask": data.attn_mask}
        for name in names:
            if name in self.buffers:
                self.binding.bind_ortvalue_input(name, self.buffers[name])
            else:
                self.binding.bind_cpu_input(name, arrays[name])
        for out in sess.get_outputs():
            if out.name.startswith("written_"):
                self.binding.bind_ortvalue_output(out.name, self.buffers[out.name.replace("written_", "cache_")])
            else:
                self.binding.bind_output(out.name, "cpu")

    def run(self) -> None:
        self.sess.run_with_iobinding(self.binding)

    def outputs(self) -> dict[str, np.ndarray]:
        names = [out.name for out in self.sess.get_outputs()]
        return dict(zip(names, self.binding.copy_outputs_to_cpu(), strict=True))


@dataclass(frozen=True)
class Agreement:
    y: dict[str, float]  # per variant but concat: max |y - y_concat| over the layers
    cache: dict[str, float]  # per variant but concat: max |its present or buffer[:, :, :W + 1] - concat's present|


def steps(case: Case, threads: int) -> dict[str, BoundStep]:
    """Each variant's session bound to the same step data."""
    data = StepData.random(case)
    models = {"concat": concat_model(case), "concat nodes": concat_model(case, separate=True)}
    models |= {lengths: in_place_model(case, lengths) for lengths in LENGTHS}
    return {name: BoundStep(session(model, threads), data) for name, model in models.items()}


def agreement(case: Case, threads: int = 2) -> Agreement:
    """Runs one step of each variant on the same data and compares attention outputs and the caches they leave."""
    bound = steps(case, threads)
    for step in bound.values():
        step.run()
    reference = bound.pop("concat").outputs()
    y, cache = {}, {}
    for name, step in bound.items():
        out = step.outputs()
        y[name] = max(float(np.abs(out[f"y{i}"] - reference[f"y{i}"]).max()) for i in range(case.layers))
        presents = {f"present_{t}{i}": out.get(f"present_{t}{i}") for t in "kv" for i in range(case.layers)}
        for buffer_name, buffer in step.buffers.items():  # the bound OrtValue itself: in place means in there
            presents[buffer_name.replace("cache_", "present_")] = buffer.numpy()[:, :, : case.window + 1]
        cache[name] = max(float(np.abs(present - reference[key]).max()) for key, present in presents.items())
    return Agreement(y, cache)


def measure(case: Case, rounds: int, threads: int) -> dict[str, float]:
    """Median ms per step of each variant, sampled round-robin (benchmarks.kernel.timing)."""
    bound = steps(case, threads)
    return time_interleaved({name: partial(BoundStep.run, step) for name, step in bound.items()}, (), rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_layout", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(
        "| B | W | C | kv heads | concat (ms) | concat nodes (ms) | in place, nonpad (ms) | in place, mask (ms) "
        "| nonpad / concat | mask / concat | max abs diff |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in cases():
        check = agreement(case, args.threads)  # every timed case: same data, each variant, the y and the cache
        ms = measure(case, args.rounds, args.threads)
        cells = [case.batch, case.window, case.capacity, case.kv_heads]
        cells += [f"{ms[name]:.3f}" for name in ("concat", "concat nodes", *LENGTHS)]
        cells += [f"{ms[name] / ms['concat']:.2f}" for name in LENGTHS]
        cells += [f"{max(*check.y.values(), *check.cache.values()):.1e}"]
        print("| " + " | ".join(str(cell) for cell in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
