"""The measurements of a search as they finish: one JSON line each in OUT/measurements.jsonl, keyed by candidate,
settings and SLO, so that a rerun (after an interrupt, or with a larger budget) measures only what is not there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from optimize.measurement import Measurement

MEASUREMENTS_FILE = "measurements.jsonl"


class Checkpoint:
    """`Checkpoint(out)`: what out/measurements.jsonl holds, and each new measurement appended to it at once."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / MEASUREMENTS_FILE
        self.records: dict[str, Measurement] = {}
        self.unreadable = 0  # lines that could not be read back (the last one, cut short by a kill, say)
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    measured = Measurement.from_json(json.loads(line))
                except (ValueError, TypeError, KeyError):
                    self.unreadable += 1
                    continue
                self.records[measured.key] = measured  # a key recorded twice: the later one

    def get(self, key: str) -> Measurement | None:
        return self.records.get(key)

    def add(self, measured: Measurement) -> None:
        """Append one line and make it durable before the next measurement starts."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = self.path.is_file() and self.path.stat().st_size > 0 and not self.path.read_bytes().endswith(b"\n")
        with open(self.path, "a") as f:
            if torn:  # a line cut short by a kill: end it, so that the new one stays readable
                f.write("\n")
            f.write(json.dumps(measured.to_json(), separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[measured.key] = measured
