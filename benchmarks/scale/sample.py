"""What a window costs the machine: CPU of the server's process tree and of each serving process (/proc), the serving
processes' CPU by kind of thread (their OS names), the whole machine's busy share (/proc/stat), and the GPU's busy
share sampled by `nvidia-smi -lms 200` where there is one."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.harness.processes import command_line, cpu_seconds, thread_cpu, thread_names
from service.thread_names import ENGINE, LOOP, RUNS

INGRESS = "ServeReplica:mha:ingress"  # a serving process's title (Ray names a replica's worker by its actor)
THREAD_KINDS = ("loop", "runs", "ort", "other")  # a serving process's threads, told apart by thread_kind
GPU_QUERY = ["--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"]


def tree_cpu(pids: list[int]) -> dict[int, float]:
    """CPU seconds so far of each of `pids` still there."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile
            out[pid] = cpu_seconds(pid)
    return out


def thread_kind(name: str) -> str:
    """A serving process's thread by its OS name (service/thread_names.py): the event loop (HTTP, gRPC, handlers), a
    model's run threads (batch, ORT call, the wait for the GPU), the threads ORT and CUDA started for a model, or
    other (Ray's, gRPC's, Python's)."""
    if name == LOOP:
        return "loop"
    if name.startswith(RUNS):
        return "runs"
    return "ort" if name.startswith(ENGINE) else "other"


def threads_cpu(pids: list[int]) -> dict[tuple[int, int], float]:
    """CPU seconds so far of every thread of `pids`, by (pid, thread id)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            out |= {(pid, tid): cpu for tid, cpu in thread_cpu(pid).items()}
    return out


def serving_processes(pids: list[int]) -> list[int]:
    return [pid for pid in pids if INGRESS in command_line(pid)]


def machine_ticks(stat: str | None = None) -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat's first line (idle and iowait are not busy)."""
    fields = [int(x) for x in (stat or Path("/proc/stat").read_text()).splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is within user)
    return total - fields[3] - fields[4], total


class CpuWindow:
    """CPU of a server's tree, its serving processes and the machine between `begin()` and `end()`."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.serving = pids, serving_processes(pids)

    def begin(self) -> None:
        self._t, self._cpu, self._ticks = time.monotonic(), tree_cpu(self.pids), machine_ticks()
        self._threads = threads_cpu(self.serving)

    def end(self) -> dict:
        """`server_cpu_cores` (the tree's CPU seconds per second), `serving_cpu_pct` (each serving process's, in %
        of one core, by PID), `thread_cpu_s` (the serving processes' CPU seconds by kind of thread, THREAD_KINDS) and
        `machine_busy_pct` (every core's time busy, anyone's work)."""
        wall, cpu, (busy, total) = time.monotonic() - self._t, tree_cpu(self.pids), machine_ticks()
        threads, names = threads_cpu(self.serving), {}
        self._used_by_thread = {key: seconds - self._threads.get(key, 0.0) for key, seconds in threads.items()}
        for pid in self.serving:
            with contextlib.suppress(OSError):
                names |= {(pid, tid): name for tid, name in thread_names(pid).items()}
        used = {pid: cpu[pid] - self._cpu[pid] for pid in cpu if pid in self._cpu}
        kinds = dict.fromkeys(THREAD_KINDS, 0.0)
        for key, seconds in self._used_by_thread.items():  # a thread started within the window counts from 0
            kinds[thread_kind(names.get(key, ""))] += seconds
        busy0, total0 = self._ticks
        return {
            "server_cpu_cores": sum(used.values()) / wall,
            "serving_cpu_pct": {str(pid): 100 * used.get(pid, 0.0) / wall for pid in self.serving},
            "thread_cpu_s": kinds,
            "machine_busy_pct": 100 * (busy - busy0) / max(1, total - total0),
        }

    def thread_cpu_s(self, pid: int) -> dict[int, float]:
        """CPU seconds of each thread of serving process `pid` over the window ended, by thread id."""
        return {tid: seconds for (owner, tid), seconds in self._used_by_thread.items() if owner == pid}


class GpuSampler:
    """`with GpuSampler() as gpu:` nvidia-smi's utilization.gpu every 200 ms, when there is an nvidia-smi; its mean
    over a window (`busy_pct`), None without one."""

    def __init__(self, enabled: bool = True) -> None:
        self.exe = shutil.which("nvidia-smi") if enabled else None
        self.samples: list[tuple[float, float]] = []  # (time.monotonic(), % busy)
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        if self.exe:
            self._proc = subprocess.Popen(
                [self.exe, *GPU_QUERY], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):  # "[N/A]" or a partial line
                self.samples.append((time.monotonic(), float(line.strip())))

    @property
    def present(self) -> bool:
        return self._proc is not None

    def busy_pct(self, start: float, end: float) -> float | None:
        """The mean of the samples taken between `start` and `end` (every GPU's), or None."""
        inside = [value for t, value in self.samples if start <= t <= end]
        return sum(inside) / len(inside) if inside else None

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait(5)
            self._reader.join(5)
