"""The cluster-faults run's figures and verdict (issue 28, item 3), from the load client's record of every request and
the run's timeline: per fault, what was sent, in flight at the fault, failed at a first attempt, lost after retries,
when the full rate was back, the longest gap, latency; and each line of the bar. Pure functions. No torch.

"Full rate" per 1-s bin of scheduled send times: at least FULL_SHARE of the requests scheduled in that second got a
200 at their first attempt within PROMPT_S of their scheduled time. Binned by schedule, not by completion, so a
backlog answered in a burst after a stall does not pass for a full second. The rate is back at the first bin from
which every bin up to the end of the fault's quiet span is full (at least HOLD_BINS of them).
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from itertools import pairwise
from pathlib import Path

import numpy as np

from benchmarks.bar import Line

BIN_S = 1.0
FULL_SHARE = 0.9  # of a bin's scheduled requests answered 200 at first attempt, promptly
PROMPT_S = 1.0  # "promptly": from the scheduled send time
HOLD_BINS = 3  # the full rate must hold this many bins at least to count as back
BACK_WITHIN_S = 15.0  # the bar: full rate back within this long after the fault


@dataclass(frozen=True)
class Record:
    """One request of the load client; times are monotonic seconds (one clock for every process of the machine).
    Outcomes: the HTTP status as text, or a transport error's kind (connect_error, reset, closed, timeout, error)."""

    i: int
    model: str
    scheduled: float  # when the open loop was due to send it
    sent: float  # when its first attempt began
    first_end: float  # when its first attempt ended
    first: str  # its first attempt's outcome: what a client without retries sees
    end: float  # when its last attempt ended
    outcome: str  # its last attempt's outcome: what a client with retries sees
    attempts: int

    @property
    def first_ok(self) -> bool:
        return self.first == "200"

    @property
    def ok(self) -> bool:
        return self.outcome == "200"


RECORD_FIELDS = tuple(f.name for f in fields(Record))


def write_records(path: Path, records: Iterable[Record]) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(RECORD_FIELDS)
        for r in records:
            out.writerow([f"{v:.6f}" if isinstance(v, float) else v for v in asdict(r).values()])


def read_records(path: Path) -> list[Record]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    kinds = {f.name: f.type for f in fields(Record)}  # "int", "str", "float" (postponed annotations)
    cast = {"int": int, "float": float, "str": str}
    return [Record(**{k: cast[kinds[k]](v) for k, v in row.items()}) for row in rows]


@dataclass(frozen=True)
class FaultSpan:
    """One fault in the run's timeline (monotonic seconds). The spans of successive faults tile the run: each
    runs from its steady load before the fault (`start`) to the next one's `start`."""

    name: str
    what: str  # what was killed, in words
    start: float  # steady load began (the settle before the fault)
    at: float  # the fault's instant: the signal sent
    observe_end: float
    quiet_until: float  # nothing else was done to the cluster before this (a replacement node starts here)
    end: float
    recovered_s: float | None  # from `at` until every check passed; None: not within the wait
    problems: tuple[str, ...] = ()  # what was still broken when the wait gave up


@dataclass(frozen=True)
class FaultResult:
    name: str
    what: str
    sent: int  # requests sent in the span
    in_flight: int  # first attempts under way at the fault's instant
    failed_first: int  # first attempts not answered 200
    failed_first_unexplained: int  # ... of requests not in flight at the fault
    lost: int  # not answered 200 after the retries
    lost_unexplained: int  # ... of requests not in flight at the fault
    failed_after: int  # first attempts not answered 200, of requests sent after the fault
    first_failures: dict[str, int]  # first-attempt outcomes other than 200, by outcome
    lost_outcomes: dict[str, int]  # last outcomes other than 200, by outcome
    retried: int  # requests that needed more than one attempt
    back_s: float | None  # full rate back this long after the fault; None: not within the quiet span
    longest_gap_s: float  # longest time without a first-attempt 200 ending, from the fault to the quiet span's end
    p99_before_ms: float  # requests sent in the steady load before the fault, answered 200 (after retries)
    p99_ms: float  # requests sent in the observe window, answered 200 (after retries), from their scheduled time
    max_ms: float
    recovered_s: float | None
    problems: tuple[str, ...]
    full_by_second: tuple[float, ...]  # per 1-s bin from the fault: share of its requests answered in full


def in_span(records: Iterable[Record], start: float, end: float) -> list[Record]:
    """Requests whose first attempt began in [start, end)."""
    return [r for r in records if start <= r.sent < end]


def in_flight(records: Iterable[Record], t: float) -> list[Record]:
    """Requests whose first attempt was under way at `t`: begun at or before it, not yet ended."""
    return [r for r in records if r.sent <= t < r.first_end]


def full_shares(records: Sequence[Record], start: float, end: float, bin_s: float = BIN_S) -> list[float]:
    """Per whole bin of scheduled times in [start, end): the share of its requests answered 200 at the first attempt
    within PROMPT_S of their scheduled time (nan for a bin where nothing was scheduled)."""
    n = max(0, math.floor((end - start) / bin_s + 1e-9))
    scheduled, prompt = np.zeros(n), np.zeros(n)
    for r in records:
        k = math.floor((r.scheduled - start) / bin_s)
        if 0 <= k < n:
            scheduled[k] += 1
            prompt[k] += r.first_ok and r.first_end - r.scheduled <= PROMPT_S
    with np.errstate(invalid="ignore", divide="ignore"):
        return list(prompt / scheduled)


def full_rate_back_s(shares: Sequence[float], bin_s: float = BIN_S) -> float | None:
    """Seconds from the first bin to the first one from which every bin to the end is full (a bin where nothing was
    scheduled is not); None when the last HOLD_BINS bins are not all full."""
    back = None
    for k in range(len(shares) - 1, -1, -1):
        if not shares[k] >= FULL_SHARE:  # nan is not full
            break
        back = k
    if back is None or len(shares) - back < HOLD_BINS:
        return None
    return back * bin_s


def longest_gap_s(records: Iterable[Record], start: float, end: float) -> float:
    """The longest time in [start, end] with no first attempt ending in a 200 (from `start` to the first, between
    two, from the last to `end`)."""
    ends = sorted(r.first_end for r in records if r.first_ok and start <= r.first_end <= end)
    edges = [start, *ends, end]
    return max(b - a for a, b in pairwise(edges))


def latency_ms(records: Iterable[Record], q: float) -> float:
    """The q-th percentile of (last end - scheduled) over the requests answered 200 after retries; nan if none."""
    ms = [(r.end - r.scheduled) * 1e3 for r in records if r.ok]
    return float(np.percentile(ms, q)) if ms else float("nan")


def analyse(records: Sequence[Record], span: FaultSpan) -> FaultResult:
    window = in_span(records, span.start, span.end)
    flying = {r.i for r in in_flight(window, span.at)}
    failed = [r for r in window if not r.first_ok]
    lost = [r for r in window if not r.ok]
    before = in_span(window, span.start, span.at)
    observed = in_span(window, span.at, span.observe_end)
    shares = full_shares(records, span.at, span.quiet_until)
    return FaultResult(
        name=span.name,
        what=span.what,
        sent=len(window),
        in_flight=len(flying),
        failed_first=len(failed),
        failed_first_unexplained=sum(r.i not in flying for r in failed),
        lost=len(lost),
        lost_unexplained=sum(r.i not in flying for r in lost),
        failed_after=sum(r.sent > span.at for r in failed),
        first_failures=dict(Counter(r.first for r in failed).most_common()),
        lost_outcomes=dict(Counter(r.outcome for r in lost).most_common()),
        retried=sum(r.attempts > 1 for r in window),
        back_s=full_rate_back_s(shares),
        longest_gap_s=longest_gap_s(records, span.at, span.quiet_until),
        p99_before_ms=latency_ms(before, 99),
        p99_ms=latency_ms(observed, 99),
        max_ms=latency_ms(observed, 100),
        recovered_s=span.recovered_s,
        problems=span.problems,
        full_by_second=tuple(round(s, 3) for s in shares),
    )


def fault_lines(result: FaultResult) -> list[Line]:
    """The bar for one fault: none lost but what was in flight at it (judged after the client's retries; "in flight
    on what died" approximated by every first attempt in flight at the fault), full rate back within
    BACK_WITHIN_S, nothing broken afterwards."""
    back = "not back" if result.back_s is None else f"back after {result.back_s:g} s"
    recovered = "never" if result.recovered_s is None else f"{result.recovered_s:.1f} s after the fault"
    return [
        Line(
            f"{result.name}: lost only in flight",
            f"{result.lost} lost after retries ({result.failed_first} failed at first attempt); {result.in_flight} "
            f"in flight at the fault; lost and not in flight: {result.lost_unexplained}",
            "every lost request was in flight at the fault",
            result.lost_unexplained == 0,
        ),
        Line(
            f"{result.name}: full rate back",
            f"{back} (longest gap without a 200 {result.longest_gap_s:.1f} s)",
            f"within {BACK_WITHIN_S:g} s",
            result.back_s is not None and result.back_s <= BACK_WITHIN_S,
        ),
        Line(
            f"{result.name}: nothing broken after",
            f"every check passed {recovered}"
            + (f"; still broken: {'; '.join(result.problems)}" if result.problems else ""),
            "every model answers 200, the application RUNNING, replicas at target on distinct nodes, proxies HEALTHY",
            result.recovered_s is not None and not result.problems,
        ),
    ]


def steady_line(name: str, records: Sequence[Record], start: float, end: float) -> Line:
    """A span with no fault in it (before the first, after the last): every request answered 200 at its first
    attempt, every second at the full rate. A first attempt still under way at `end` belongs to what follows (the
    next fault's in-flight count)."""
    window = in_span(records, start, end)
    failed = Counter(r.first for r in window if not r.first_ok and r.first_end <= end)
    shares = full_shares(records, start, end)
    short = sum(not s >= FULL_SHARE for s in shares)
    lag = max(((r.sent - r.scheduled) * 1e3 for r in window), default=float("nan"))
    return Line(
        name,
        f"{len(window):,} requests over {end - start:.0f} s, {sum(failed.values())} not answered 200 at first attempt"
        + (f" ({', '.join(f'{k}: {v}' for k, v in failed.items())})" if failed else "")
        + f"; {short} of {len(shares)} seconds below the full rate; p99 {latency_ms(window, 99):.0f} ms (the "
        f"client sent up to {lag:.0f} ms late)",
        f"all answered, every second at >= {FULL_SHARE:.0%} of the rate",
        bool(window) and not failed and short == 0 and bool(shares),
    )


def table(results: Sequence[FaultResult]) -> str:
    """One row per fault: the docs' table."""
    rows = [
        "| fault | sent | in flight at the fault | failed at first attempt (not in flight) | lost after retries "
        "(not in flight) | first-attempt failures | full rate back | longest gap | p99 before / p99, max after "
        "| back to health |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for r in results:
        kinds = ", ".join(f"{k} {v}" for k, v in r.first_failures.items()) or "none"
        back = "not back" if r.back_s is None else f"{r.back_s:g} s"
        health = "never" if r.recovered_s is None else f"{r.recovered_s:.1f} s"
        rows.append(
            f"| {r.name} | {r.sent:,} | {r.in_flight} | {r.failed_first} ({r.failed_first_unexplained}) | {r.lost} "
            f"({r.lost_unexplained}) | {kinds} | {back} | {r.longest_gap_s:.1f} s | {r.p99_before_ms:.0f} / "
            f"{r.p99_ms:.0f}, {r.max_ms:.0f} ms | {health} |"
        )
    return "\n".join(rows)
