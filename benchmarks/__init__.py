"""Benchmarks and profilers of mha-serving: developer tools, not installed (pyproject.toml's package list leaves this
folder out, and the image does not copy it), so they may import anything: `service`, `export`, `loadtest`, torch.
Run from the repository root, e.g. `python -m benchmarks.serving`, `python -m benchmarks.kernel`."""
