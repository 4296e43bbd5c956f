"""From raw samples to one load level's numbers: percentiles, throughput, errors by status, offered versus achieved."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from loadtest.streams import GENERATION_PROTOCOLS, StreamTiming
from loadtest.workload import DEFAULT_PROTOCOL, PROTOCOLS

PERCENTILES = (50, 90, 95, 99)
# A model listing or report without a precision comes from before the service served quantized variants: fp32.
DEFAULT_PRECISION = "fp32"
PRECISION_ORDER = ("fp32", "fp16", "int8")  # the source model first, then its narrower variants
ORDER = (*PROTOCOLS, *(p for p in GENERATION_PROTOCOLS if p not in PROTOCOLS))


def precision_rank(precision: str) -> int:
    """Where a precision sorts among models of the same h: fp32, fp16, int8, then any other."""
    return PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else len(PRECISION_ORDER)


def protocol_rank(protocol: str) -> int:
    """Where a protocol sorts among the same model's levels: in the order `--protocol` documents, then any other."""
    return ORDER.index(protocol) if protocol in ORDER else len(ORDER)


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

    model: str  # or route
    heads: int | str  # a route's targets' (discovery.route_model), e.g. "8|4"
    head_dim: int | str
    d_model: int | str
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
    # a route (reports from before routes have none of these): its configured weights by target model, its
    # successful answers by the model that said it answered, and its shadow's agreement (agreement.shadow_report)
    targets: dict[str, float] = field(default_factory=dict)
    answered_by: dict[str, int] = field(default_factory=dict)
    shadow: dict[str, object] = field(default_factory=dict)
    # a decoder's level (reports from before generation have none): its key/value heads, and the streams' figures
    # (generation_summary); latency_ms is then the streams' end to end, and `server` the TTFT histogram's
    kv_heads: int = 0
    generation: dict[str, object] = field(default_factory=dict)

    @property
    def is_generation(self) -> bool:
        return bool(self.generation)

    @property
    def is_route(self) -> bool:
        return bool(self.targets)

    @property
    def group_key(self) -> tuple[int, int, int, str, int, str]:
        """How results are grouped and sorted for comparison: models by h, then routes; then by precision (fp32
        first), then protocol."""
        heads = self.heads if isinstance(self.heads, int) and not self.is_route else 0
        precision = (precision_rank(self.precision), self.precision)
        return int(self.is_route), heads, *precision, protocol_rank(self.protocol), self.protocol

    @property
    def weight_shares(self) -> dict[str, float]:
        """A route's configured share of each target (weight / sum of weights)."""
        total = sum(self.targets.values())
        return {model: weight / total for model, weight in self.targets.items()} if total > 0 else {}

    @property
    def shares(self) -> dict[str, float]:
        """The share of successful answers each model gave, its targets first (in the route's order)."""
        answered = sum(self.answered_by.values())
        order = [*self.targets, *(m for m in self.answered_by if m not in self.targets)]
        return {m: self.answered_by.get(m, 0) / answered for m in order} if answered else {}

    @property
    def agreement_rate(self) -> float:
        """Agreeing rows / rows compared by the route's shadow during the level; nan when none were."""
        rate = self.shadow.get("agreement")
        return float(rate) if isinstance(rate, int | float) else math.nan

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
        out["shares"] = {model: round(share, 6) for model, share in self.shares.items()}
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


@dataclass(frozen=True)
class Slo:
    """Goodput's bounds: a request is good when its TTFT and every one of its inter-token gaps are within them (a
    bound not given holds for every request)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.itl_ms is not None

    def met_by(self, timing: StreamTiming) -> bool:
        if self.ttft_ms is not None and timing.ttft_s * 1000 > self.ttft_ms:
            return False
        return self.itl_ms is None or all(gap * 1000 <= self.itl_ms for gap in timing.gaps_s)


def generation_summary(streams: list[StreamTiming], failed: int, window_s: float, slo: Slo) -> dict[str, object]:
    """A level's streams: TTFT, ITL (every gap of every stream), TPOT and e2e percentiles (ms), output tokens and
    their rate, and with an SLO the goodput: the good requests' share of all answered (failures are never good) and
    their rate."""
    tpots = [t for s in streams if (t := s.tpot_s) is not None]
    out: dict[str, object] = {
        "requests": len(streams),
        "ttft_ms": latency_summary([s.ttft_s for s in streams]),
        "itl_ms": latency_summary([gap for s in streams for gap in s.gaps_s]),
        "tpot_ms": latency_summary(tpots),
        "e2e_ms": latency_summary([s.e2e_s for s in streams]),
        "prompt_tokens": sum(s.prompt_tokens for s in streams),
        "output_tokens": sum(s.tokens for s in streams),
        "output_tokens_per_s": round(sum(s.tokens for s in streams) / window_s, 3) if window_s > 0 else 0.0,
    }
    if slo.given:
        good = sum(1 for s in streams if slo.met_by(s))
        answered = len(streams) + failed
        out["goodput"] = {
            "slo_ttft_ms": slo.ttft_ms,
            "slo_itl_ms": slo.itl_ms,
            "good": good,
            "share": round(good / answered, 6) if answered else None,
            "rate_rps": round(good / window_s, 3) if window_s > 0 else 0.0,
        }
    return out
