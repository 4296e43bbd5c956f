"""Benchmarks and profilers of mha-serving: developer tools, not installed (pyproject.toml's package list leaves this
folder out, and the image does not copy it), so they may import anything. A package or module per study, run from the
repository root (`python -m benchmarks.serving`, `python -m benchmarks.soak`, ...); `harness/` is what tests share."""
