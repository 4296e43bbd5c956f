"""`python -m benchmarks.cluster_faults`."""

import sys

from benchmarks.cluster_faults.cli import main

if __name__ == "__main__":
    sys.exit(main())
