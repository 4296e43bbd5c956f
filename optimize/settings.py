"""The serving settings `mha-serving optimize` searches over (serving processes, ORT intra-op threads, batch size and
wait) and the `mha-serving serve --config` file each one becomes; also the space they are drawn from: a coarse grid
and each setting's neighbours.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

DRAIN_S = 2.0  # the measured server is stopped once idle: nothing in flight needs the default 8 s


def machine_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's count)."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True, order=True)
class ServingSettings:
    """One way to serve a candidate. Keys as in the report's serve config (optimize/report.py serve_config)."""

    processes: int = 1  # serving processes sharing the port (ingress.processes)
    intra_op_threads: int = 1  # ORT threads of each process's session
    max_batch_size: int = 32
    batch_wait_ms: float = 0.0

    @property
    def key(self) -> str:
        return f"p{self.processes}-t{self.intra_op_threads}-b{self.max_batch_size}-w{self.batch_wait_ms:g}"

    def cores(self, machine: int | None = None) -> int:
        """Cores the setting keeps busy at saturation: processes x threads, at most the machine's."""
        return min(self.processes * self.intra_op_threads, machine or machine_cores())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> ServingSettings:
        return cls(**record)

    def serve_config(self, folder: Path, backend: str = "cpu") -> dict[str, Any]:
        """The `mha-serving serve --config` file that serves the model in `folder` (alone) this way. Not checked
        here: the server is the one judge of a config, and a setting it refuses is a measurement that failed."""
        return {
            "models_dir": str(folder.resolve().parent),
            "models": [folder.name],
            "backend": backend,
            "deployment": {
                "intra_op_threads": self.intra_op_threads,
                # the threads asked for, even for a light model (the service caps those at 1 by default): the
                # search, not a rule of thumb, decides whether a second thread pays
                "light_model_threads": None,
                "max_batch_size": self.max_batch_size,
                "batch_wait_timeout_s": self.batch_wait_ms / 1000.0,
            },
            "ingress": {"processes": self.processes},
            "limits": {"drain_s": DRAIN_S},
        }


def _powers_of_two(limit: int) -> tuple[int, ...]:
    return tuple(2**i for i in range(limit.bit_length()) if 2**i <= limit)


@dataclass(frozen=True)
class SearchSpace:
    """The values each setting may take. The coarse grid spreads the cores (every processes x threads layout that
    fits the machine) at one batching; the local search then moves one axis a step at a time, batching included."""

    processes: tuple[int, ...]
    intra_op_threads: tuple[int, ...]
    max_batch_size: tuple[int, ...] = (1, 8, 32)
    batch_wait_ms: tuple[float, ...] = (0.0, 2.0, 5.0)
    coarse_batch_sizes: tuple[int, ...] = (32,)  # the service's default batching
    coarse_waits_ms: tuple[float, ...] = (0.0,)
    cores: int = 0  # the machine's; 0: this one's

    def __post_init__(self) -> None:
        for name in ("processes", "intra_op_threads", "max_batch_size", "batch_wait_ms"):
            object.__setattr__(self, name, tuple(sorted(set(getattr(self, name)))))  # a step is to the next value

    @classmethod
    def for_machine(cls, cores: int | None = None) -> SearchSpace:
        """Processes up to every core, threads up to 4 (the service's own cap for a co-located model)."""
        cores = cores or machine_cores()
        return cls(_powers_of_two(cores), _powers_of_two(min(cores, 4)), cores=cores)

    @property
    def machine(self) -> int:
        return self.cores or machine_cores()

    def fits(self, settings: ServingSettings) -> bool:
        return settings.processes * settings.intra_op_threads <= self.machine

    def coarse(self) -> list[ServingSettings]:
        """Every layout of the cores that fits, fewest cores first (the cheapest are the ones worth finding)."""
        grid = [
            ServingSettings(p, t, b, w)
            for p, t, b, w in itertools.product(
                self.processes, self.intra_op_threads, self.coarse_batch_sizes, self.coarse_waits_ms
            )
        ]
        return sorted((s for s in grid if self.fits(s)), key=lambda s: s.cores(self.machine))

    def neighbours(self, settings: ServingSettings) -> list[ServingSettings]:
        """The settings one step away on one axis, that fit the machine, fewest cores first."""
        found = []
        for name in ("processes", "intra_op_threads", "max_batch_size", "batch_wait_ms"):
            axis: tuple = getattr(self, name)
            value = getattr(settings, name)
            if value not in axis:
                continue
            i = axis.index(value)
            found += [replace(settings, **{name: axis[j]}) for j in (i - 1, i + 1) if 0 <= j < len(axis)]
        return sorted((s for s in found if self.fits(s)), key=lambda s: s.cores(self.machine))
