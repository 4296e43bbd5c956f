"""Wire protocols of the HTTP API, one module each: `v2` (Open Inference Protocol) and `simple` (JSON). No torch."""
