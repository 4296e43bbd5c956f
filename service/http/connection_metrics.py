"""Connection metrics of the ingress's own HTTP server: heads cut off by `limits.header_timeout_s`, connections
refused over `limits.max_connections`, and the connections open now. Exported through Ray's metrics pipeline like
service/metrics.py's. No torch.
"""

from __future__ import annotations


class ConnectionMetrics:
    """Counted by the server's protocol (service/http/uvicorn_adapter.py) as plain integers, totals since start;
    `refresh` adds what was counted since the last refresh to Ray's counters and sets the gauge again (Ray drops a
    gauge value not set within two export intervals: service/metrics.py GAUGE_REFRESH_S)."""

    def __init__(self) -> None:
        # Imported here: the launcher reaches this module through service/local/ray_env.py before it sets Ray's
        # environment, and Ray reads that environment once, when first imported.
        from ray.serve.metrics import Counter, Gauge

        self.open = 0  # connections open now, refused ones still closing included
        self.header_timeouts = 0  # connections whose head did not arrive within header_timeout_s
        self.refused = 0  # connections refused over max_connections
        self._exported_timeouts = self._exported_refused = 0
        self._timeouts_counter = Counter(
            "mha_http_header_timeouts_total",
            description="Connections to the ingress's own HTTP server whose request head did not arrive within "
            "limits.header_timeout_s: answered 408 and closed, or closed if they sent nothing.",
        )
        self._refused_counter = Counter(
            "mha_http_connections_refused_total",
            description="Connections to the ingress's own HTTP server refused (503, closed) over "
            "limits.max_connections.",
        )
        self._open_gauge = Gauge(
            "mha_http_open_connections",
            description="Connections open to the ingress's own HTTP server, refused ones still closing included.",
        )

    def refresh(self) -> None:
        self._open_gauge.set(self.open)
        timeouts, refused = self.header_timeouts, self.refused  # the protocol runs on this loop: no race
        if timeouts > self._exported_timeouts:
            self._timeouts_counter.inc(timeouts - self._exported_timeouts)
        if refused > self._exported_refused:
            self._refused_counter.inc(refused - self._exported_refused)
        self._exported_timeouts, self._exported_refused = timeouts, refused
