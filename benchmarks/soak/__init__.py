"""The soak benchmark (`python -m benchmarks.soak`): its load client in a process of its own (load), the server's
process tree and metrics export sampled (sample), issue 28's bar judged (verdict), CSV, Markdown and PNGs (report),
and the run with its command line (run)."""
