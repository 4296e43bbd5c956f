"""The serving benchmark (`python -m benchmarks.serving`): `mha-serving serve`, run as a user starts it, against bare
ONNX Runtime and a plain FastAPI + ORT server, in rounds of every figure with the other servers paused. Not a test:
numbers are noisy on shared cores; compare within a run. No torch (missing models are exported by a subprocess)."""
