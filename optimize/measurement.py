"""What one measurement of one candidate with one serving setting against one SLO found, as kept in the checkpoint
file (one JSON object a line) and handed to the report: every load window, the p99 at the SLO's rate, saturation
throughput and the highest rate within the p99 bar, or why it failed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from optimize.report import Point, Slo
from optimize.settings import ServingSettings


@dataclass(frozen=True)
class Window:
    """One measured load window (warm-up excluded): open loop at `level` requests/s, or closed at `level` workers."""

    mode: str  # "open" | "closed"
    level: float
    seconds: float
    sent: int
    ok: int
    errors: dict[str, int]  # HTTP status or transport error -> count
    dropped: int  # open loop: arrivals not sent, the outstanding cap reached
    rps: float  # successful requests per second
    p50_ms: float | None
    p99_ms: float | None
    cores: int  # the setting's (processes x threads, at most the machine's)
    client_cpu_pct: float  # the load tester's own CPU (100 = a core): on a small machine it competes

    @property
    def sustained(self) -> bool:
        """Every request sent was answered 200, none dropped: the server kept up with what it was offered."""
        return self.sent > 0 and self.ok == self.sent and not self.errors and not self.dropped

    def within(self, p99_ms: float | None) -> bool:
        return self.sustained and (p99_ms is None or (self.p99_ms is not None and self.p99_ms <= p99_ms))


def holds_rate(windows: tuple[Window, ...], p99_ms: float | None, bar_ms: float | None) -> bool:
    """At the SLO's rate: every window kept up, and their p99 is within the bar (without one, keeping up is all)."""
    kept_up = bool(windows) and all(w.sustained for w in windows)
    return kept_up and p99_ms is not None and (bar_ms is None or p99_ms <= bar_ms)


def slo_key(slo: Slo) -> str:
    return f"p99={slo.p99_ms if slo.p99_ms is not None else '-'}:rate={slo.rate if slo.rate is not None else '-'}"


def measurement_key(candidate: str, settings: ServingSettings, slo: Slo, confirms: bool = False) -> str:
    """What a measurement is recorded under: a rerun with the same key finds it and measures nothing. A
    confirmation (the same configuration again, on a fresh server) has a key of its own."""
    return f"{candidate}|{settings.key}|{slo_key(slo)}{'|confirms' if confirms else ''}"


@dataclass(frozen=True)
class Measurement:
    candidate: str  # the model's name (its folder's)
    folder: str
    settings: ServingSettings
    slo: Slo
    cores: int
    failure: str = ""  # why nothing was measured (the server did not start, say); "" when measured
    precision: str = ""  # as the server lists the model
    at_rate: tuple[Window, ...] = ()  # open loop at the SLO's rate, until p99 was stable
    p99_ms: float | None = None  # at the SLO's rate: the median of the last windows' p99
    p50_ms: float | None = None
    stable: bool = False  # the last windows' p99 agreed within the plan's spread
    saturation: Window | None = None  # closed loop at a concurrency that saturates
    rate_probes: tuple[Window, ...] = ()  # the search for the highest rate within the SLO's p99, in order
    max_rate: float | None = None  # the highest rate measured with p99 within the SLO (None: none was)
    ready_s: float | None = None  # from start to ready
    exit_status: int | None = None  # after SIGTERM (None: killed, or never started)
    stop_s: float | None = None
    seconds: float = 0.0  # the whole measurement: start, load, stop
    measured_at: str = ""  # UTC, ISO 8601
    notes: tuple[str, ...] = field(default_factory=tuple)
    confirms: bool = False  # measured again on a fresh server, to confirm the search's choice

    @property
    def key(self) -> str:
        return measurement_key(self.candidate, self.settings, self.slo, self.confirms)

    @property
    def sustained(self) -> bool:
        """At the SLO's rate, every window kept up (no SLO rate: nothing to keep up with)."""
        return bool(self.at_rate) and all(w.sustained for w in self.at_rate)

    def meets(self, slo: Slo | None = None) -> bool:
        """Against `slo` (default: the one it was measured for; a headroom is a verdict, not part of the key)."""
        return self.point().meets(slo or self.slo)

    def point(self, candidate: dict[str, Any] | None = None) -> Point:
        """For the report: with `candidate`, its entry of candidates.json (accuracy, heads kept). At the SLO's rate,
        p99 counts only where every window kept up: a server that drops or refuses requests has no p99 there."""
        entry = candidate or {}
        drop_ci = entry.get("drop_ci_points")
        return Point(
            candidate=self.candidate,
            precision=entry.get("precision") or self.precision or "fp32",
            heads_fraction=float(entry.get("heads_fraction", 1.0)),
            settings=self.settings.to_json(),
            cores=float(self.cores),
            accuracy_drop=entry.get("accuracy_drop_points"),
            drop_ci=tuple(drop_ci) if drop_ci else None,
            agreement=entry.get("agreement"),
            p99_ms=self.p99_ms if self.sustained else None,
            max_rate=self.max_rate,
            saturation_rps=self.saturation.rps if self.saturation else None,
            failure=self.failure,
        )

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, **asdict(self)}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Measurement:
        values = {k: v for k, v in record.items() if k != "key"}
        values["settings"] = ServingSettings.from_json(values["settings"])
        values["slo"] = Slo(**values["slo"])
        values["at_rate"] = tuple(Window(**w) for w in values.get("at_rate", ()))
        values["rate_probes"] = tuple(Window(**w) for w in values.get("rate_probes", ()))
        values["saturation"] = Window(**values["saturation"]) if values.get("saturation") else None
        values["notes"] = tuple(values.get("notes", ()))
        return cls(**values)


def finite_ms(value: float | None) -> float | None:
    """A percentile in ms for the record: None for no samples (loadtest's NaN)."""
    return None if value is None or math.isnan(value) else round(value, 3)
