"""`python -m benchmarks.slow_heads`."""

import sys

from benchmarks.slow_heads.cli import main

if __name__ == "__main__":
    sys.exit(main())
