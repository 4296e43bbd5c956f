"""Ray's metrics export as a scraper sees it: one timed GET of a Prometheus text exposition, and its series (the
sample lines) counted. Loopback only. No torch.
"""

from __future__ import annotations

import time

import httpx


def export_url(port: int) -> str:
    """Where a metrics export on loopback `port` serves its exposition."""
    return f"http://127.0.0.1:{port}/metrics"


def scrape(url: str, timeout_s: float = 60) -> tuple[str, float]:
    """The exposition's text and the seconds its GET took; httpx.HTTPError unless it answered 200."""
    start = time.perf_counter()
    response = httpx.get(url, timeout=timeout_s)
    took = time.perf_counter() - start
    response.raise_for_status()
    return response.text, took


def series(exposition: str) -> list[str]:
    """The sample lines of a Prometheus text exposition: those neither comments nor blank, one per series."""
    return [line for line in exposition.splitlines() if line and not line.startswith("#")]


def series_count(exposition: str) -> int:
    return len(series(exposition))
