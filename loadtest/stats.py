"""From raw samples to one load level's numbers: percentiles, throughput, errors by status, offered versus achieved."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from loadtest.workload import DEFAULT_PROTOCOL, PROTOCOLS

PERCENTILES = (50, 90, 95, 99)
# A model listing or report without a precision comes from before the service served quantized variants: fp32.
DEFAULT_PRECISION = "fp32"
PRECISION_ORDER = ("fp32", "fp16", "int8")  # the source model first, then its narrower variants


def precision_rank(precision: str) -> int:
    """Where a precision sorts among models of the same h: fp32, fp16, int8, then any other."""
    return PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else len(PRECISION_ORDER)


def protocol_rank(protocol: str) -> int:
    """Where a protocol sorts among the same model's levels: in the order `--protocol` documents, then any other."""
    return PROTOCOLS.index(protocol) if protocol in PROTOCOLS else len(PROTOCOLS)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class LevelResult:
    """One model at one load level: what was sent, what came back, how fast."""

    model: str
    heads: int
    head_dim: int
    d_model: int
    mode: str  # "closed" (fixed concurrency) or "open" (Poisson arrivals at a fixed rate)
    concurrency: int  # closed: workers; open: the cap on outstanding requests
    offered_rate: float  # open: requests/s asked for; closed: 0
    batch_size: int
    duration_s: float  # measured window, warm-up excluded
    sent: int
    ok: int
    errors: dict[str, int] = field(default_factory=dict)  # HTTP status or transport error -> count
    dropped: int = 0  # open loop: arrivals not sent because the outstanding cap was reached
    throughput_rps: float = 0.0  # successful requests per second
    sequences_per_s: float = 0.0
    latency_ms: dict[str, float] = field(default_factory=dict)  # p50, p90, p95, p99, max, mean
    send_lag_p99_ms: float = 0.0  # open loop: how late the client sent versus the schedule
    stopped_by: str = "duration"  # duration | max_requests | interrupted | aborted: ...
    error_examples: dict[str, str] = field(default_factory=dict)
    client_cpu_pct: float = 0.0  # the load tester's own CPU time over the window (100 = one core busy)
    warmup_sent: int = 0  # requests of the warm-up before this level (not in any other number here)
    warmup_ok: int = 0
    server: dict[str, object] = field(default_factory=dict)  # server-side percentiles, or a note why not
    precision: str = DEFAULT_PRECISION  # fp32 | int8 | fp16 (last, with a default: older reports have none)
    # simple | v2 | v2-binary | grpc; a report from before levels had one names it once (report.load_report)
    protocol: str = DEFAULT_PROTOCOL

    @property
    def group_key(self) -> tuple[int, int, str, int, str]:
        """How results are grouped and sorted for comparison: by h, then by precision (fp32 first), then protocol."""
        return self.heads, precision_rank(self.precision), self.precision, protocol_rank(self.protocol), self.protocol

    @property
    def level(self) -> str:
        return f"c={self.concurrency}" if self.mode == "closed" else f"rate={self.offered_rate:g}/s"

    @property
    def achieved_rate(self) -> float:
        """Requests per second that got any HTTP answer (open loop: compare with offered_rate)."""
        answered = self.ok + sum(n for k, n in self.errors.items() if k.isdigit())
        return answered / self.duration_s if self.duration_s > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["level"] = self.level
        out["achieved_rate"] = round(self.achieved_rate, 3)
        return out

    @classmethod
    def from_json(cls, data: dict) -> LevelResult:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def latency_summary(latencies_s: list[float]) -> dict[str, float]:
    """p50/p90/p95/p99/max/mean in milliseconds (empty when nothing succeeded)."""
    if not latencies_s:
        return {}
    ms = [x * 1000.0 for x in latencies_s]
    out = {f"p{q}": round(percentile(ms, q), 3) for q in PERCENTILES}
    out["max"] = round(max(ms), 3)
    out["mean"] = round(sum(ms) / len(ms), 3)
    return out
