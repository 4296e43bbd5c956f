"""The harness tests and benchmarks share: a real `mha-serving serve` process (server), a local multi-node Ray
cluster (cluster), a real Prometheus (prometheus), Ray's metrics export as scraped (exposition), waiting on a check
(polling), and what /proc says of processes and their sockets (processes, sockets)."""
