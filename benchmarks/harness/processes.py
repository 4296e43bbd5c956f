"""Processes by PID, as /proc tells of them: the tree under one, each one's command line, CPU, memory, threads and
descriptors; and the signals a test or benchmark sends to processes it started (stop, continue, kill). No torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def children() -> dict[int, list[int]]:
    """Parent PID -> the PIDs of its children, for every process now running."""
    found: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        found.setdefault(ppid, []).append(int(stat.parent.name))
    return found


def descendants(pid: int) -> list[int]:
    """`pid` (first) and every process below it."""
    below, found, todo = children(), [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(below.get(current, []))
    return found


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces; "" once it has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants_named(root: int, marker: str) -> list[int]:
    """The processes below `root` (not itself) whose command line contains `marker` (e.g. a Serve replica's title)."""
    return [pid for pid in descendants(root)[1:] if marker in command_line(pid)]


def pids_mentioning(marker: str) -> list[int]:
    """Every process whose command line names `marker` (e.g. a temp dir of its own)."""
    pids = (int(path.parent.name) for path in Path("/proc").glob("[0-9]*/cmdline"))
    return [pid for pid in pids if marker in command_line(pid)]


def pids_with_env(name: str, value: str) -> list[int]:
    """Every process whose environment sets `name` to `value` (ours only: others' environments are unreadable)."""
    entry = f"{name}={value}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if entry in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far, from /proc/PID/stat."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU time of each thread of one process so far, by thread id, from /proc/PID/task."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[int(task.name)] = _stat_cpu(task / "stat")
    return out


def thread_names(pid: int) -> dict[int, str]:
    """The OS name of each thread of one process (/proc/PID/task/TID/comm), by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[int(task.name)] = (task / "comm").read_text().strip()
    return out


def py_spy() -> str:
    """The py-spy executable: on PATH, or the venv's beside this Python (the venv unactivated)."""
    return shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


def python_threads(pid: int) -> dict[int, str]:
    """Thread id -> Python thread name of one process, from `py-spy dump`; empty if py-spy cannot (it says why)."""
    try:
        dump = subprocess.run([py_spy(), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"py-spy dump failed: {exc}", file=sys.stderr)
        return {}
    return {int(m[1]): m[2] for m in re.finditer(r'^Thread (\d+) \([^)]*\): "([^"]*)"', dump.stdout, re.M)}


def rollup_kib(smaps_rollup: str) -> tuple[int, int]:
    """(Rss, Pss) in KiB of a /proc/PID/smaps_rollup text."""
    found = {}
    for line in smaps_rollup.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss"):
            found[name] = int(rest.split()[0])
    return found.get("Rss", 0), found.get("Pss", 0)


def memory_kib(pid: int, field: str) -> int:
    """A process's `Rss` or `Pss` from /proc/PID/smaps_rollup, in KiB (0 if it is gone)."""
    try:
        rss, pss = rollup_kib(Path(f"/proc/{pid}/smaps_rollup").read_text())
    except OSError:
        return 0
    return {"Rss": rss, "Pss": pss}[field]


def status_threads(status: str) -> int:
    """The `Threads:` count of a /proc/PID/status text."""
    for line in status.splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise ValueError("no Threads: line in the status text")


def thread_count(pid: int) -> int:
    """How many threads one process has now; OSError once it has gone."""
    return status_threads(Path(f"/proc/{pid}/status").read_text())


def descriptors(pid: int) -> list[str]:
    """What each open descriptor of one process points at (a path, `socket:[INODE]`, `pipe:[...]`)."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            out.append(os.readlink(fd))
    return out


def fd_count(pid: int) -> int:
    """How many descriptors one process has open now; OSError once it has gone."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def signal_all(pids: list[int], sig: int) -> None:
    """`sig` to each of `pids` that is still there and ours to signal."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@contextlib.contextmanager
def paused(pids: list[int]):
    """Every process in `pids` stopped (SIGSTOP) inside the block and continued after it: a server frozen while
    another is measured uses no CPU (Ray's background wakes ~1,100 times a second idle), yet keeps its state, so
    servers can be measured in turn, round after round. Ray's health checks allow seconds of silence."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
