"""`python -m benchmarks.soak`."""

import sys

from benchmarks.soak.run import main

if __name__ == "__main__":
    sys.exit(main())
