"""The slow-heads benchmark (`python -m benchmarks.slow_heads`): slow request heads and a probe against one server
(clients), the probe's latency and the ingress replica's descriptors judged against the bar (verdict), the run
and its command line (cli)."""
