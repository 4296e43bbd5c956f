"""The kernel benchmark (`python -m benchmarks.kernel`): the model's forward pass in torch and in ONNX Runtime per head
count and shape (runs), timed interleaved (timing), against GEMM peaks measured in the same run (gemm), as issue 14's
bar's ratios (summary) and a table, CSV, JSON and a plot (report)."""
