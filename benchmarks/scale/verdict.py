"""The bars a scaling run serves (docs/performance.md, "The whole node"; and two processes on 2 cores), each line
judged where the run measured it, or saying why it did not."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.scale.figures import best, level_of, pair_ratio
from benchmarks.scale.levels import Level

NODE_RATE = 25_000  # requests/s, h8 d512 fp16, one sequence per request, on the GPU machine
C1_ALLOWANCE_MS = 1.0  # c=1 p50 over bare ORT's batch-1 p50
FP16_OVER_FP32 = 1.3  # served, at saturation
GPU_BUSY_PCT = 60.0  # at saturation
CPU_SCALING = (8, 5.0)  # CPU backend, small model: 8 processes at least 5 x one
TWO_CORES = (2, 1.0, 32)  # on 2 cores: 2 processes at least 1.0 x one, at c=32 in all
NODE_MODEL = (8, 512)  # heads, d_model: the default model
SMALL_MODEL = (4, 128)


@dataclass(frozen=True)
class BarLine:
    name: str
    bar: str
    measured: str = ""
    ok: bool | None = None  # None: not measured
    why_not: str = ""

    @property
    def text(self) -> str:
        if self.ok is None:
            return f"{self.name}: {self.bar}: not measured ({self.why_not})"
        return f"{self.name}: {self.measured}; bar {self.bar}: {'ok' if self.ok else 'NOT MET'}"


def _gpu_lines(rows: dict, got: dict, facts: dict) -> list[BarLine]:
    names = ("h8 d512 fp16 rate", "c=1 p50 against bare", "fp16 over fp32", "GPU busy")
    bars = (f">= {NODE_RATE:,} req/s", f"<= bare + {C1_ALLOWANCE_MS:g} ms", f">= {FP16_OVER_FP32:g} x", ">= 60 %")
    if facts["backend"] != "gpu":
        return [BarLine(n, b, why_not="the GPU machine's: --backend gpu") for n, b in zip(names, bars, strict=True)]
    precisions = facts["precisions"]
    node = "fp16" if "fp16" in precisions else precisions[0]
    top = best(rows, node)
    lines = []
    if facts["model"] == NODE_MODEL and "fp16" in precisions:
        ok = top["rate"] >= NODE_RATE
        lines.append(BarLine(names[0], bars[0], f"{top['rate']:,.0f} req/s at {level_of(top).label}", ok))
    else:
        lines.append(BarLine(names[0], bars[0], why_not="needs --model default --precision fp16"))
    extra = top["c1_minus_bare_ms"]
    measured = f"{top['c1_p50_ms']:.2f} ms against {top['bare_p50_ms']:.2f} ms (+{extra:.2f}) at {level_of(top).label}"
    lines.append(BarLine(names[1], bars[1], measured, extra <= C1_ALLOWANCE_MS))
    if {"fp16", "fp32"} <= set(precisions):
        a, b = best(rows, "fp16"), best(rows, "fp32")
        ratio = pair_ratio(got, level_of(a), level_of(b))
        measured = f"{ratio:.2f} x ({level_of(a).label} over {level_of(b).label})"
        lines.append(BarLine(names[2], bars[2], measured, ratio >= FP16_OVER_FP32))
    else:
        lines.append(BarLine(names[2], bars[2], why_not="needs --precision fp32,fp16"))
    busy = top.get("gpu_busy_pct")
    if busy is None or busy != busy:  # no nvidia-smi, or no sample in the windows
        lines.append(BarLine(names[3], bars[3], why_not="no nvidia-smi samples"))
    else:
        lines.append(BarLine(names[3], bars[3], f"{busy:.0f} % at {level_of(top).label}", busy >= GPU_BUSY_PCT))
    return lines


def _ratio_line(name: str, bar: str, got: dict, facts: dict, n: int, minimum: float) -> BarLine:
    precision = "fp32" if "fp32" in facts["precisions"] else facts["precisions"][0]
    if not {1, n} <= set(facts["processes"]):
        return BarLine(name, bar, why_not=f"needs --processes 1,{n}")
    ratio = pair_ratio(got, Level(precision, n), Level(precision, 1))
    measured = f"{ratio:.2f} x ({precision}, {facts['cores']} cores, c={facts['connections']})"
    return BarLine(name, bar, measured, ratio >= minimum)


def verdict(rows: dict[str, dict], got: dict[str, dict], facts: dict) -> list[BarLine]:
    """Every bar line. `facts`: backend, model (heads, d_model), precisions, processes, cores, connections (the
    loaded windows' in all)."""
    lines = _gpu_lines(rows, got, facts)
    n, minimum = CPU_SCALING
    name, bar = f"CPU small model {n} processes over 1", f">= {minimum:g} x"
    if facts["backend"] != "cpu" or facts["model"] != SMALL_MODEL:
        lines.append(BarLine(name, bar, why_not="needs --backend cpu --model small"))
    else:
        lines.append(_ratio_line(name, bar, got, facts, n, minimum))
    cores, minimum, connections = TWO_CORES
    name, bar = "2 cores: 2 processes over 1 at c=32", f">= {minimum:g} x"
    if facts["backend"] != "cpu" or facts["cores"] != cores or facts["connections"] != connections:
        lines.append(BarLine(name, bar, why_not="on a 2-core machine, --backend cpu, clients x concurrency = 32"))
    else:
        lines.append(_ratio_line(name, bar, got, facts, 2, minimum))
    return lines
