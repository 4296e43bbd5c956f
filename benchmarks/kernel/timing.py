"""How the kernel benchmark times a call: samples taken round-robin across the calls compared, each after a pause and
one untimed call, short calls repeated to last about 50 ms; the median per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

SAMPLE_S, SAMPLE_CALLS = 0.05, 100  # a timed sample repeats a short call to last about 50 ms (at most 100 calls)


SETTLE_S = 0.1  # pause before a sample: ORT's idle threads spin for a while and slowed the next runner down


def time_interleaved(
    calls: dict[str, Callable[..., object]], args: tuple, repeats: int, settle_s: float = SETTLE_S
) -> dict[str, float]:
    """Median ms of each `call(*args)`. Samples go round-robin, so that all calls share the machine's drift; each
    starts after a pause and one untimed call, so that no call pays for the still-spinning threads of the last."""
    warm = []
    for call in calls.values():
        start = time.perf_counter()
        call(*args)
        warm.append(time.perf_counter() - start)
    per_sample = min(SAMPLE_CALLS, max(1, round(SAMPLE_S / max(min(warm), 1e-9))))  # short calls: several
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            time.sleep(settle_s)
            call(*args)  # untimed: wakes this runner's threads
            start = time.perf_counter()
            for _ in range(per_sample):
                call(*args)
            samples[name].append((time.perf_counter() - start) / per_sample * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}
