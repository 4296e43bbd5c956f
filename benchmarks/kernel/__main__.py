"""`python -m benchmarks.kernel`."""

import sys

from benchmarks.kernel.cli import main

if __name__ == "__main__":
    sys.exit(main())
