"""One measurement's figures, the same keys for every system: output tokens per second over the whole measurement,
and the medians of time to first token, time per output token (a request's last token minus its first, over the
tokens between) and inter-token latency (every gap between two tokens of one request; also its p99 and largest).
No torch."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Timed:
    """One request (or one row of a batch): when it was sent and when each of its tokens arrived (perf_counter)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0  # as the answer's usage counts them (the token times' count where there is none)
    error: str = ""


def figures(timed: list[Timed], seconds: float) -> dict:
    """The measurement's figures over its requests (errors counted, their tokens not)."""
    ok = [t for t in timed if not t.error and t.token_times]
    ttft = [t.token_times[0] - t.sent for t in ok]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) for t in ok if len(t.token_times) > 1]
    itl = [b - a for t in ok for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    tokens = sum(t.tokens or len(t.token_times) for t in ok)
    return {
        "tokens_s": tokens / seconds if seconds > 0 else 0.0,
        "ttft_p50_ms": _median_ms(ttft),
        "tpot_p50_ms": _median_ms(tpot),
        "itl_p50_ms": _median_ms(itl),
        "itl_p99_ms": float(np.percentile(itl, 99)) * 1e3 if itl else float("nan"),
        "itl_max_ms": max(itl) * 1e3 if itl else float("nan"),
        "tokens": float(tokens),
        "requests": float(len(ok)),
        "errors": len(timed) - len(ok),
    }


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")
