"""`python -m benchmarks.serving`."""

from benchmarks.serving.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
