"""The answer of `mha-serving optimize`: the cheapest configuration that meets the SLO (named with why), the Pareto
frontiers (accuracy against p99 and against throughput) as PNGs, report.md and report.json stamped with the machine
they were measured on and the commands that reproduce them, the winner's model folder and a ready serve config.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from optimize.settings import ServingSettings


@dataclass(frozen=True)
class Slo:
    p99_ms: float | None = None  # at `rate` (or at the highest rate that keeps it, without one)
    rate: float | None = None  # requests/s
    # A rate is met only with this much spare: the highest rate within the p99 bar (saturation, without a bar) at
    # least (1 + headroom) x rate. At its knee a configuration's p99 swings with the machine's noise (docs/optimize.md).
    headroom: float = 0.0

    def describe(self) -> str:
        parts = [
            f"p99 <= {self.p99_ms:g} ms" if self.p99_ms is not None else "",
            f"at {self.rate:g} req/s" if self.rate else "",
            f"with {self.headroom:.0%} headroom" if self.rate and self.headroom else "",
        ]
        return " ".join(p for p in parts if p) or "none"

    @property
    def spare_rate(self) -> float | None:
        """The rate a configuration must hold to meet this SLO with its headroom (None without a rate)."""
        return None if self.rate is None else self.rate * (1 + self.headroom)

    def without_headroom(self) -> Slo:
        return Slo(self.p99_ms, self.rate)


@dataclass(frozen=True)
class Point:
    """One candidate served with one setting, as measured: what it costs, how fast, how accurate."""

    candidate: str  # the model's name (its folder)
    precision: str
    heads_fraction: float
    settings: dict[str, Any]  # serving settings: processes, intra_op_threads, max_batch_size, batch_wait_ms
    cores: float  # processes x ORT threads (CPU), or the GPU share
    accuracy_drop: float | None  # points, against the fp32 source (None: agreement only)
    drop_ci: tuple[float, float] | None
    agreement: float | None
    p99_ms: float | None  # at the SLO's rate
    max_rate: float | None  # the highest rate measured whose p99 stays within the SLO
    saturation_rps: float | None
    failure: str = ""  # why it was not measured (the server did not start, say)

    @property
    def label(self) -> str:
        """The candidate and its settings' key: p(rocesses)-t(hreads)-b(atch)-w(ait ms)."""
        return f"{self.candidate} [{ServingSettings.from_json(self.settings).key}]"

    def meets(self, slo: Slo) -> bool:
        if self.failure:
            return False
        if slo.rate is not None:
            within = self.p99_ms is not None and (slo.p99_ms is None or self.p99_ms <= slo.p99_ms)
            return within and (not slo.headroom or (self.capacity(slo) or 0.0) >= slo.spare_rate)
        return self.max_rate is not None and self.max_rate > 0

    def capacity(self, slo: Slo) -> float | None:
        """The highest rate it holds: within the p99 bar, or (a rate-only SLO) at saturation."""
        return self.max_rate if slo.p99_ms is not None else self.saturation_rps


@dataclass(frozen=True)
class Answer:
    winner: Point | None
    why: str
    closest: Point | None = None  # when nothing meets the SLO: the nearest miss
    frontier: list[Point] = field(default_factory=list)
    # label -> the same configuration measured again on a fresh server (optimize/search.py's confirmation)
    confirmations: dict[str, Point] = field(default_factory=dict)


def confirmed(again: Point, slo: Slo) -> bool:
    """A fresh run confirms a configuration when it meets the SLO again; the headroom is the margin it may lose."""
    return again.meets(slo.without_headroom())


def choose(points: Sequence[Point], slo: Slo, confirmations: dict[str, Point] | None = None) -> Answer:
    """The cheapest point meeting the SLO: fewest cores, then the lowest p99, then the smallest accuracy drop; with
    a p99 bar and no rate, the most requests/s per core. A point a fresh run did not confirm never wins. Without
    one: the closest miss, and why."""
    confirmations = confirmations or {}
    refuted = {label for label, again in confirmations.items() if not confirmed(again, slo)}
    meeting = [p for p in points if p.meets(slo) and p.label not in refuted]
    frontier = pareto(points, lambda p: p.p99_ms)
    if meeting:
        if slo.rate is not None:
            best = min(meeting, key=lambda p: (p.cores, p.p99_ms, p.accuracy_drop or 0.0))
            why = (
                f"the fewest cores ({best.cores:g}) that keep {slo.describe()}: p99 {best.p99_ms:.1f} ms, "
                f"{_capacity(best, slo)}, accuracy drop {_drop(best)}; {len(meeting)} of {len(points)} measured "
                "configurations meet it"
            )
        else:
            best = max(meeting, key=lambda p: (p.max_rate / p.cores, -(p.accuracy_drop or 0.0)))
            why = (
                f"the most requests/s per core within p99 <= {slo.p99_ms:g} ms: {best.max_rate:.0f} req/s on "
                f"{best.cores:g} core(s), accuracy drop {_drop(best)}"
            )
        if best.label in confirmations:
            why += f"; {_confirmation(best, confirmations[best.label], slo)}"
        return Answer(best, why, frontier=frontier, confirmations=confirmations)
    measured = [p for p in points if not p.failure]
    if not measured:
        return Answer(None, "no configuration could be measured", frontier=frontier, confirmations=confirmations)
    closest = min(
        measured,
        key=lambda p: (
            p.label in refuted,
            not p.meets(slo.without_headroom()),
            p.p99_ms if p.p99_ms is not None else math.inf,
            -(p.capacity(slo) or 0.0),
            p.cores,
        ),
    )
    if slo.rate is not None:
        figures = f"p99 {_num(closest.p99_ms, 1)} ms, {_capacity(closest, slo)}"
    else:
        figures = f"no rate within the bar, saturation {_num(closest.saturation_rps, 0)} req/s"
    why = f"no configuration meets {slo.describe()}; the closest: {figures} with {closest.label}"
    if closest.label in confirmations:
        why += f"; {_confirmation(closest, confirmations[closest.label], slo)}"
    return Answer(None, why, closest, frontier, confirmations)


def _capacity(p: Point, slo: Slo) -> str:
    capacity = p.capacity(slo)
    if slo.rate is None:
        return ""
    if capacity is None:
        return "no rate held"
    held = "within the p99 bar" if slo.p99_ms is not None else "at saturation"
    return f"{capacity:.0f} req/s held {held} ({capacity / slo.rate:.2f} x the SLO's rate)"


def _confirmation(first: Point, again: Point, slo: Slo) -> str:
    verdict = "confirmed" if confirmed(again, slo) else "not confirmed"
    return f"{verdict} on a fresh server: {_ratios(first, again)}"


def _ratios(first: Point, again: Point) -> str:
    """The fresh run's figures beside the first's: p99 at the rate, the highest rate within the bar, saturation."""
    parts = []
    for name, a, b, digits in (
        ("p99", first.p99_ms, again.p99_ms, 1),
        ("max rate", first.max_rate, again.max_rate, 0),
        ("saturation", first.saturation_rps, again.saturation_rps, 0),
    ):
        if a is None and b is None:
            continue
        ratio = f" ({b / a:.2f} x)" if a and b is not None else ""
        parts.append(f"{name} {_num(a, digits)} -> {_num(b, digits)}{ratio}")
    return ", ".join(parts) or "nothing to compare"


def pareto(points: Sequence[Point], cost) -> list[Point]:
    """The points no other beats on both accuracy drop and `cost` (lower is better for both)."""
    scored = [(p, cost(p), p.accuracy_drop if p.accuracy_drop is not None else 0.0) for p in points if not p.failure]
    scored = [(p, c, d) for p, c, d in scored if c is not None and not math.isnan(c)]
    front = [p for p, c, d in scored if not any((c2 <= c and d2 <= d) and (c2 < c or d2 < d) for _, c2, d2 in scored)]
    return sorted(front, key=cost)


def machine() -> dict[str, Any]:
    """Where the figures were measured: CPU model and flags that matter to ORT, cores, GPU, ORT and Python."""
    import onnxruntime as ort

    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0))}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), ""
        )
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
        info["cpu"] = model or info["cpu"]
        info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")) or "vnni" in f)
    except OSError:
        pass
    info["gpu"] = _gpu_name()
    info["onnxruntime"] = ort.__version__
    info["providers"] = ort.get_available_providers()
    info["python"] = platform.python_version()
    return info


def _gpu_name() -> str:
    if shutil.which("nvidia-smi") is None:
        return "none"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip().replace("\n", ", ") or "none"


def write(
    out: Path,
    answer: Answer,
    points: Sequence[Point],
    slo: Slo,
    commands: list[str],
    candidates_dir: Path,
    backend: str = "cpu",
) -> Path:
    """report.md, report.json and the frontier PNGs in `out`; with a winner, its model folder under out/winner/
    and out/serve.yaml. Returns report.md's path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = machine()
    winner = answer.winner
    if winner is not None:
        target = out / "winner" / winner.candidate
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(candidates_dir / winner.candidate, target)
        config = ServingSettings.from_json(winner.settings).serve_config(target, backend)
        config["limits"].pop("drain_s", None)  # the measuring servers' quick stop; a served one keeps the default
        (out / "serve.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    plots = _plots(out, points, answer)
    report = {
        "slo": asdict(slo),
        "winner": asdict(winner) if winner else None,
        "why": answer.why,
        "closest": asdict(answer.closest) if answer.closest else None,
        "frontier": [p.label for p in answer.frontier],
        "confirmations": {label: asdict(again) for label, again in answer.confirmations.items()},
        "points": [asdict(p) for p in points],
        "machine": stamp,
        "commands": commands,
        "plots": plots,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    path = out / "report.md"
    path.write_text(_markdown(answer, points, slo, stamp, commands, plots))
    return path


def _drop(p: Point) -> str:
    if p.accuracy_drop is None:
        return f"n/a (agreement {p.agreement:.4f})" if p.agreement is not None else "n/a"
    ci = f" (95 % CI {p.drop_ci[0]:+.2f}..{p.drop_ci[1]:+.2f})" if p.drop_ci else ""
    return f"{p.accuracy_drop:+.2f} points{ci}"


def _markdown(
    answer: Answer, points: Sequence[Point], slo: Slo, stamp: dict, commands: list[str], plots: list[str]
) -> str:
    lines = ["# mha-serving optimize", "", f"SLO: {slo.describe()}", ""]
    if answer.winner is not None:
        lines += [f"**Winner: {answer.winner.label}**: {answer.why}.", ""]
        lines += ["Serve it: `mha-serving serve --config serve.yaml` (the model folder is under `winner/`).", ""]
    else:
        lines += [f"**No winner**: {answer.why}.", ""]
    lines += ["| configuration | cores | accuracy drop | agreement | p99 at rate (ms) | max rate in SLO | saturation |"]
    lines += ["| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    on_front = {p.label for p in answer.frontier}
    for p in sorted(points, key=lambda p: (p.cores, p.candidate)):
        if p.failure:
            lines.append(f"| {p.label} | {p.cores:g} | {_drop(p)} | | failed: {p.failure} | | |")
            continue
        mark = " (frontier)" if p.label in on_front else ""
        agree = f"{p.agreement:.4f}" if p.agreement is not None else "n/a"
        lines.append(
            f"| {p.label}{mark} | {p.cores:g} | {_drop(p)} | {agree} | {_num(p.p99_ms, 1)} | {_num(p.max_rate, 0)} | "
            f"{_num(p.saturation_rps, 0)} |"
        )
    if answer.confirmations:
        by_label = {p.label: p for p in points}
        lines += ["", "Measured again, each on a fresh server:", ""]
        lines += [
            f"- {label}: {_confirmation(by_label[label], again, slo)}"
            for label, again in answer.confirmations.items()
            if label in by_label
        ]
    lines += ["", *[f"![{Path(p).stem}]({p})" for p in plots], ""]
    lines += ["## Machine", "", "```json", json.dumps(stamp, indent=2), "```", ""]
    lines += ["## Reproduce", "", "```bash", *commands, "```", ""]
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _plots(out: Path, points: Sequence[Point], answer: Answer) -> list[str]:
    """accuracy drop against p99 and against saturation throughput, the frontier joined; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    measured = [p for p in points if not p.failure]
    written = []
    for name, x_of, cost, x_label, why_missing in (
        (
            "frontier_p99.png",
            lambda p: p.p99_ms,
            lambda p: p.p99_ms,
            "p99 at the SLO's rate (ms)",
            "did not keep up with the rate",
        ),
        (
            "frontier_throughput.png",
            lambda p: p.saturation_rps,
            lambda p: -p.saturation_rps if p.saturation_rps is not None else None,
            "saturation throughput (req/s)",
            "no saturation window",
        ),
    ):
        shown = [p for p in measured if x_of(p) is not None]
        if not shown:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for precision in sorted({p.precision for p in shown}):
            mine = [p for p in shown if p.precision == precision]
            ax.scatter([x_of(p) for p in mine], [p.accuracy_drop or 0.0 for p in mine], label=precision)
        front = sorted(pareto(shown, cost), key=x_of)
        ax.plot(
            [x_of(p) for p in front],
            [p.accuracy_drop or 0.0 for p in front],
            "k--o",
            lw=1,
            mfc="none",
            ms=11,
            label="frontier",
        )
        if answer.winner is not None and x_of(answer.winner) is not None:
            ax.scatter(
                [x_of(answer.winner)],
                [answer.winner.accuracy_drop or 0.0],
                marker="*",
                s=250,
                c="gold",
                edgecolors="k",
                label="winner",
                zorder=3,
            )
        drops = [0.0, *(p.accuracy_drop or 0.0 for p in shown)]
        pad = max(0.25, (max(drops) - min(drops)) * 0.1)  # no zoom into a few hundredths of a point
        ax.set_ylim(min(drops) - pad, max(drops) + pad)
        if len(shown) < len(measured):
            ax.text(
                0.01,
                0.01,
                f"not shown: {len(measured) - len(shown)} configuration(s), {why_missing}",
                transform=ax.transAxes,
                fontsize=8,
            )
        ax.set_xlabel(x_label)
        ax.set_ylabel("accuracy drop (points)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written
