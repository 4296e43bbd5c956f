"""The serving settings search for the candidates that survived stage 1: a coarse grid (every layout of the cores, all
candidates at the fewest cores first), then a local search around the best, one axis a step at a time, while the
budget lasts, then the choice measured again on a fresh server (a choice the fresh run refutes is set aside, and the
next one confirmed). Every finished measurement is checkpointed; a rerun reuses what is recorded and measures the rest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from optimize.checkpoint import Checkpoint
from optimize.measure import MeasurePlan, Progress, measure, to_stderr
from optimize.measurement import Measurement, measurement_key
from optimize.report import Slo, choose
from optimize.settings import SearchSpace, ServingSettings

SERVERS_DIR = "servers"  # each measurement's serve config and the server's stdout and stderr

Measure = Callable[[Path, ServingSettings, Slo, MeasurePlan, Path, Progress], Measurement]


class Budget:
    """Seconds for this run's measurements; a measurement starts only if its estimated cost still fits."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if seconds <= 0:
            raise ValueError(f"the budget must be positive seconds, got {seconds:g}")
        self.seconds, self.clock, self.started = seconds, clock, clock()

    @property
    def spent(self) -> float:
        return self.clock() - self.started

    def allows(self, estimate_s: float) -> bool:
        return self.spent + estimate_s <= self.seconds


@dataclass(frozen=True)
class SearchResult:
    measurements: tuple[Measurement, ...]  # every one the search looked at, recorded earlier or measured now
    measured: int  # started by this run
    reused: int  # found in the checkpoint
    stopped_by: str  # "done" | "budget"
    best: Measurement | None  # the cheapest meeting the SLO: fewest cores, then lowest p99 (optimize/report.py)
    closest: Measurement | None  # without one: the nearest miss
    why: str
    confirmations: tuple[Measurement, ...] = ()  # choices measured again on a fresh server, in order


class _Search:
    def __init__(
        self,
        slo: Slo,
        plan: MeasurePlan,
        out: Path,
        budget: Budget,
        measure: Measure,
        progress: Progress,
        confirm: bool,
    ):
        self.slo, self.plan, self.out, self.budget = slo, plan, Path(out), budget
        self.measure, self.progress, self.confirm = measure, progress, confirm
        self.checkpoint = Checkpoint(self.out)
        self.done: dict[str, Measurement] = {}  # by key, in the order looked at
        self.confirmations: dict[str, Measurement] = {}  # by the configuration's label
        self.costs: list[float] = []  # seconds of this run's measured (not failed) ones
        self.measured = self.reused = 0
        self.stopped_by = "done"

    def visit(self, folder: Path, settings: ServingSettings) -> None:
        """Reuse the recorded measurement, or measure if the budget allows and a cheaper setting does not already
        meet the SLO."""
        key = measurement_key(folder.name, settings, self.slo)
        if key in self.done:
            return
        recorded = self.checkpoint.get(key)
        if recorded is not None:
            self.done[key] = recorded
            self.reused += 1
            self.progress(f"{self._where()} {folder.name} [{settings.key}]: recorded, {summary(recorded, self.slo)}")
            return
        if self.stopped_by == "budget":
            return
        cheapest = self._cheapest_meeting()
        if cheapest is not None and settings.cores() > cheapest:
            return  # more cores than a configuration that already meets the SLO: it cannot be the cheapest
        estimate = self._estimate()
        reserve = estimate if self.confirm else 0.0  # the search leaves room to confirm its choice
        if not self.budget.allows(estimate + reserve):
            self.stopped_by = "budget"
            self.progress(
                f"{self._where()} budget spent: {folder.name} [{settings.key}] would take ~{estimate:.0f} s; "
                "no more measurements start"
            )
            return
        measured = self._measure(folder, settings)
        self.done[key] = measured
        self.progress(f"{self._where()} {folder.name} [{settings.key}]: {summary(measured, self.slo)}")

    def confirm_choice(self, folders: dict[str, Path]) -> None:
        """The chosen configuration measured again on a fresh server (or found recorded); one the fresh run does not
        confirm is set aside and the next choice measured, while the budget lasts."""
        while True:
            winner, _, _ = self.answer()
            if winner is None or winner.point().label in self.confirmations:
                return
            label, key = winner.point().label, measurement_key(winner.candidate, winner.settings, self.slo, True)
            again = self.checkpoint.get(key)
            if again is None:
                estimate = self._estimate()
                if not self.budget.allows(estimate):
                    self.progress(f"{self._where()} no budget left to confirm {label} (~{estimate:.0f} s): unconfirmed")
                    return
                self.progress(f"{self._where()} confirming {label} on a fresh server")
                again = self._measure(folders[winner.candidate], winner.settings, confirms=True)
            self.confirmations[label] = again
            self.progress(f"{self._where()} {label} again: {summary(again, self.slo)}")

    def _measure(self, folder: Path, settings: ServingSettings, confirms: bool = False) -> Measurement:
        """One measurement on a server of its own, checkpointed at once and counted in this run's costs."""
        workdir = self.out / SERVERS_DIR / f"{folder.name}-{settings.key}{'-confirms' if confirms else ''}"
        measured = self.measure(folder, settings, self.slo, self.plan, workdir, self.progress)
        measured = replace(measured, confirms=confirms)
        self.checkpoint.add(measured)
        self.measured += 1
        if not measured.failure:
            self.costs.append(measured.seconds)
        return measured

    def _estimate(self) -> float:
        """Seconds one more measurement will take: the mean of this run's, or the plan's estimate before any."""
        return statistics.mean(self.costs) if self.costs else self.plan.estimate_s(self.slo)

    def _cheapest_meeting(self) -> int | None:
        """The fewest cores of a measured configuration meeting a rate SLO (None without a rate: then the most
        requests/s per core wins, and more cores may still do better)."""
        if self.slo.rate is None:
            return None
        meeting = [m.cores for m in self.done.values() if m.meets(self.slo)]
        return min(meeting) if meeting else None

    def _where(self) -> str:
        left = max(0.0, self.budget.seconds - self.budget.spent)
        return f"[{self.measured} measured, {self.reused} recorded, {left:.0f} s of budget left]"

    def answer(self) -> tuple[Measurement | None, Measurement | None, str]:
        """The best (or, without one meeting the SLO, the closest) by optimize/report.py's rule."""
        by_label = {m.point().label: m for m in self.done.values()}
        confirmations = {label: m.point() for label, m in self.confirmations.items()}
        answer = choose([m.point() for m in self.done.values()], self.slo, confirmations)
        winner = by_label[answer.winner.label] if answer.winner else None
        closest = by_label[answer.closest.label] if answer.closest else None
        return winner, closest, answer.why


def search(
    candidates: Sequence[Path],
    slo: Slo,
    plan: MeasurePlan,
    out: Path,
    budget_s: float,
    space: SearchSpace | None = None,
    measure: Measure = measure,
    progress: Progress = to_stderr,
    confirm: bool = True,
) -> SearchResult:
    """Measure `candidates` (model folders) over `space` (default: this machine's) within `budget_s` seconds,
    checkpointing into `out`; the cheapest configuration that meets `slo`, confirmed on a fresh server (`confirm`)."""
    space = space or SearchSpace.for_machine()
    folders = [Path(c) for c in candidates]
    run = _Search(slo, plan, out, Budget(budget_s), measure, progress, confirm)
    if run.checkpoint.unreadable:
        progress(f"{run.checkpoint.path}: {run.checkpoint.unreadable} unreadable line(s) skipped (measured again)")
    grid = space.coarse()
    progress(f"coarse grid: {len(grid)} setting(s) x {len(folders)} candidate(s), budget {budget_s:.0f} s")
    for settings in grid:  # fewest cores first, every candidate at each
        for folder in folders:
            run.visit(folder, settings)
    _local(run, space, folders)
    if confirm:
        run.confirm_choice({f.name: f for f in folders})
    winner, closest, why = run.answer()
    progress(f"search {run.stopped_by}: {why}")
    return SearchResult(
        tuple(run.done.values()),
        run.measured,
        run.reused,
        run.stopped_by,
        winner,
        closest,
        why,
        tuple(run.confirmations.values()),
    )


def _local(run: _Search, space: SearchSpace, folders: list[Path]) -> None:
    """From the best so far, each neighbour in turn; a better one becomes the centre. Ends when no neighbour of the
    centre is left to measure, or the budget is spent."""
    by_name = {f.name: f for f in folders}
    tried: set[str] = set()
    while run.stopped_by != "budget":
        winner, closest, _ = run.answer()
        centre = winner or closest
        if centre is None or centre.key in tried:
            return
        tried.add(centre.key)
        run.progress(f"local search around {centre.candidate} [{centre.settings.key}]")
        for settings in space.neighbours(centre.settings):
            run.visit(by_name[centre.candidate], settings)
            if run.answer()[:2] != (winner, closest):
                break  # a better centre: search around it instead


def summary(m: Measurement, slo: Slo | None = None) -> str:
    """One line: what a measurement found, and its verdict against `slo` (default: the one it was measured for)."""
    if m.failure:
        return f"failed: {m.failure}"
    parts = []
    if m.slo.rate is not None:
        p99 = f"{m.p99_ms} ms" if m.p99_ms is not None else "n/a"
        kept = "" if m.sustained else " (did not keep up)"
        parts.append(f"p99 {p99} at {m.slo.rate:g}/s{kept}{' stable' if m.stable else ''}")
    if m.saturation is not None:
        parts.append(f"saturation {m.saturation.rps:.0f} req/s")
    if m.slo.p99_ms is not None:
        parts.append(f"max rate within p99 {m.max_rate if m.max_rate is not None else 'none'}")
    verdict = "meets the SLO" if m.meets(slo) else "misses the SLO"
    return f"{', '.join(parts)}; {m.cores} core(s), {verdict} ({m.seconds:.0f} s)"
