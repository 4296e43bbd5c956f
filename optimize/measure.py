"""One candidate, one serving setting, one SLO, measured on the real stack: the candidate served by `mha-serving serve`
(optimize/server.py) and driven by the load tester (optimize/load.py) at the SLO's rate until p99 is stable, at
saturation, and at the rates of a short search for the highest one whose p99 stays within the SLO.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from optimize.load import Driver, LoadError, find_model
from optimize.measurement import Measurement, Window, holds_rate
from optimize.report import Slo
from optimize.server import ServeError, Server, ServerStartError
from optimize.settings import ServingSettings

Progress = Callable[[str], None]


def to_stderr(line: str) -> None:
    print(f"optimize: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class MeasurePlan:
    """How long and how often to measure. The defaults suit the CLI (a 20-minute budget); tests shorten them."""

    window_s: float = 10.0
    warmup_s: float = 2.0  # unmeasured load before each level
    min_windows: int = 3  # at the SLO's rate, p99 is judged over this many last windows
    max_windows: int = 6
    max_spread: float = 0.2  # stable: (max - min) / median of those windows' p99 at most this
    saturation_concurrency: int = 32  # closed-loop workers: enough to keep every batch full on a CPU node
    rate_steps: int = 4  # probes of the search for the highest rate within the SLO's p99 (0: no search)
    seq_len: int = 32  # tokens per sequence, one sequence per request
    protocol: str = "simple"
    backend: str = "cpu"
    ready_timeout_s: float = 180.0
    startup_estimate_s: float = 30.0  # a start and a stop, for the budget, before any measurement says better

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.warmup_s < 0 or self.max_spread < 0 or self.ready_timeout_s <= 0:
            raise ValueError(f"need window_s > 0, warmup_s >= 0, max_spread >= 0, ready_timeout_s > 0; got {self}")
        if not 1 <= self.min_windows <= self.max_windows:
            raise ValueError(f"need 1 <= min_windows <= max_windows, got {self.min_windows}, {self.max_windows}")
        if self.saturation_concurrency < 1 or self.rate_steps < 0:
            raise ValueError(f"need saturation_concurrency >= 1, rate_steps >= 0; got {self}")

    def load_bound_s(self, slo: Slo) -> float:
        """The most seconds of load one measurement puts on the server."""
        level = self.warmup_s + self.window_s
        total = level  # saturation
        if slo.rate is not None:
            total += self.warmup_s + self.max_windows * self.window_s
        if slo.p99_ms is not None:
            total += self.rate_steps * level
        return total

    def estimate_s(self, slo: Slo) -> float:
        return self.startup_estimate_s + self.load_bound_s(slo)


def measure(
    folder: Path, settings: ServingSettings, slo: Slo, plan: MeasurePlan, workdir: Path, progress: Progress = to_stderr
) -> Measurement:
    """Serve the model in `folder` with `settings` and measure it against `slo`. A server that cannot start, or a
    model that cannot be driven, is a Measurement with `failure` saying why, never an exception."""
    started = time.monotonic()
    folder = Path(folder)
    cores = settings.cores()
    what = f"{folder.name} [{settings.key}]"
    fixed = {"candidate": folder.name, "folder": str(folder), "settings": settings, "slo": slo, "cores": cores}
    fixed["measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    server = Server(folder, settings, workdir, plan.backend, plan.ready_timeout_s)
    progress(f"{what}: starting mha-serving serve ({cores} core(s))")
    try:
        with server:
            progress(f"{what}: ready in {server.ready_s:.1f} s on {server.base_url}")
            model = find_model(server.base_url, folder.name, plan.ready_timeout_s)
            driver = Driver(server.base_url, model, cores, plan.seq_len, plan.protocol)
            found = _phases(driver, slo, plan, lambda line: progress(f"{what}: {line}"))
    except ServerStartError as exc:
        progress(f"{what}: failed: {exc}: {exc.reason}")
        return Measurement(**fixed, failure=f"{exc}: {exc.reason}", seconds=_since(started))
    except (ServeError, LoadError) as exc:
        progress(f"{what}: failed: {exc}")
        return Measurement(**fixed, failure=str(exc), seconds=_since(started), **_stop_fields(server))
    notes = ()
    stop = _stop_fields(server)
    if stop["exit_status"] != 0:
        notes = (f"after SIGTERM the server exited with {stop['exit_status']} (None: killed) in {stop['stop_s']} s",)
        progress(f"{what}: {notes[0]}")
    measured = Measurement(**fixed, precision=model.precision, ready_s=round(server.ready_s, 3), **found, **stop)
    return replace(measured, seconds=_since(started), notes=notes)


def _phases(driver: Driver, slo: Slo, plan: MeasurePlan, progress: Progress) -> dict:
    found: dict = {}
    if slo.rate is not None:
        windows, stable = _at_rate(driver, slo.rate, plan, progress)
        last = [w for w in windows[-plan.min_windows :] if w.p99_ms is not None]
        found["at_rate"], found["stable"] = tuple(windows), stable
        found["p99_ms"] = round(statistics.median(w.p99_ms for w in last), 3) if last else None
        found["p50_ms"] = round(statistics.median(w.p50_ms for w in last), 3) if last else None
    saturation = driver.window("closed", plan.saturation_concurrency, plan.window_s, plan.warmup_s)
    progress(f"saturation {_describe(saturation)}")
    found["saturation"] = saturation
    if slo.p99_ms is not None and plan.rate_steps > 0:
        met = None if slo.rate is None else holds_rate(found["at_rate"], found["p99_ms"], slo.p99_ms)
        probes, highest = _highest_rate(driver, slo, plan, saturation, met, progress)
        found["rate_probes"], found["max_rate"] = tuple(probes), highest
    return found


def _at_rate(driver: Driver, rate: float, plan: MeasurePlan, progress: Progress) -> tuple[list[Window], bool]:
    """Windows at `rate` until the last `min_windows` agree on p99 (or `max_windows`, or one that did not keep up:
    more would only say so again)."""
    windows: list[Window] = []
    for i in range(plan.max_windows):
        window = driver.window("open", rate, plan.window_s, plan.warmup_s if i == 0 else 0.0)
        windows.append(window)
        progress(f"at the SLO's rate, window {i + 1}: {_describe(window)}")
        if not window.sustained:
            return windows, False
        if len(windows) >= plan.min_windows and spread(windows[-plan.min_windows :]) <= plan.max_spread:
            return windows, True
    return windows, False


def spread(windows: list[Window]) -> float:
    """(max - min) / median of the windows' p99: how far they disagree (inf when one has none)."""
    p99s = [w.p99_ms for w in windows]
    if any(p is None for p in p99s) or statistics.median(p99s) <= 0:
        return float("inf")
    return (max(p99s) - min(p99s)) / statistics.median(p99s)


def _highest_rate(
    driver: Driver, slo: Slo, plan: MeasurePlan, saturation: Window, met: bool | None, progress: Progress
) -> tuple[list[Window], float | None]:
    """Bisect between what is known to hold (0, or the SLO's rate if it met the bar there) and what cannot
    (saturation, or the SLO's rate if it did not), from half the saturation throughput; where the SLO's rate held
    and the SLO asks for headroom, from the rate with that headroom, which is what the verdict turns on."""
    low, high = 0.0, saturation.rps
    if met is True:
        low, high = slo.rate, max(high, slo.rate)
    elif met is False:
        high = min(high, slo.rate)
    probes: list[Window] = []
    rate = high * 0.5 if low == 0 else (low + high) / 2
    if met is True and slo.headroom and low < slo.spare_rate < high:
        rate = slo.spare_rate
    for _ in range(plan.rate_steps):
        if high <= 0 or high - low <= 0.05 * high:  # within 5 %: another window would not tell them apart
            break
        window = driver.window("open", round(rate, 1), plan.window_s, plan.warmup_s)
        probes.append(window)
        holds = window.within(slo.p99_ms)
        progress(
            f"rate probe {window.level:g}/s {'holds' if holds else 'misses'} p99 <= {slo.p99_ms:g} ms: "
            f"{_describe(window)}"
        )
        low, high = (window.level, high) if holds else (low, window.level)
        rate = (low + high) / 2
    return probes, (round(low, 1) if low > 0 else None)


def _describe(w: Window) -> str:
    level = f"{w.level:g}/s" if w.mode == "open" else f"c={w.level:g}"
    errors = sum(w.errors.values())
    p = f"p50 {w.p50_ms} ms p99 {w.p99_ms} ms" if w.p99_ms is not None else "no answers"
    dropped = f", {w.dropped} dropped" if w.dropped else ""
    return f"{level} {w.ok}/{w.sent} ok, {errors} errors{dropped}, {w.rps:.1f} req/s, {p}"


def _stop_fields(server: Server) -> dict:
    stopped = server.stop()
    if stopped is None:
        return {"exit_status": None, "stop_s": None}
    return {"exit_status": stopped.exit_status, "stop_s": stopped.seconds}


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
