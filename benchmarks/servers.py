"""The benchmark's handle on a real `mha-serving serve` process: started from an AppConfig, ready when
/v2/health/ready answers 200, measured through /proc (RSS and PSS of its whole process tree), stopped with SIGTERM
as a user would. Loopback only. No torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from service.local.ports import free_port


def until(
    what: str,
    check: Callable[[], object],
    timeout_s: float,
    every_s: float = 1.0,
    retried: tuple[type[BaseException], ...] = (Exception,),
):
    """`check()`'s first truthy value within `timeout_s`, a check that raises one of `retried` tried again; past it,
    TimeoutError naming `what` and the last such error."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except retried as exc:
            last = exc
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what} (last error: {last!r})")


def predicts_ok(port: int, model: str, timeout_s: float = 5) -> bool:
    """Whether one simple-JSON predict to `model` on 127.0.0.1:`port` is answered 200 within `timeout_s`."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models/{model}/predict",
        data=b'{"text": "still answered?"}',
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):  # HTTPError (a non-2xx) is a URLError
        return False


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces; "" once it has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


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


def python_threads(pid: int) -> dict[int, str]:
    """Thread id -> Python thread name of one process, from `py-spy dump`; empty if py-spy cannot (it says why)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")  # the venv's, unactivated
    try:
        dump = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"py-spy dump failed: {exc}", file=sys.stderr)
        return {}
    return {int(m[1]): m[2] for m in re.finditer(r'^Thread (\d+) \([^)]*\): "([^"]*)"', dump.stdout, re.M)}


def memory_kib(pid: int, field: str) -> int:
    """A process's `Rss:` or `Pss:` from /proc/PID/smaps_rollup, in KiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class ServerProcess:
    """`with ServerProcess(config) as s:` runs `mha-serving serve --config <config>` on a free port."""

    def __init__(
        self, config: dict, extra_args: list[str] | None = None, timeout_s: float = 180, tree: Path | None = None
    ) -> None:
        """`tree`: another checkout of the project whose `service` package serves instead of this one (its path
        first on every Ray process's sys.path), to compare two versions of the code in one run."""
        self.config, self.extra_args, self.timeout_s, self.tree = config, extra_args or [], timeout_s, tree
        self.port, self.metrics_port, self.grpc_port = free_port(), free_port(), free_port()
        self.ready_s = float("nan")
        self.stop_s = float("nan")
        self._proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="mha-bench-")

    def __enter__(self) -> ServerProcess:
        path = Path(self._dir.name) / "serve.yaml"
        path.write_text(yaml.safe_dump(self.config))
        cmd = [sys.executable, "-m", "service.cli", "serve", "--config", str(path), "--port", str(self.port)]
        if self.tree is None:  # another checkout's launcher may predate gRPC (and its flag): it opens no gRPC port then
            cmd += ["--grpc-port", str(self.grpc_port)]
        cmd += ["--metrics-port", str(self.metrics_port), *self.extra_args]  # extra_args last: they win
        start = time.perf_counter()
        log = open(Path(self._dir.name) / "serve.log", "w")
        env = None
        if self.tree is not None:
            path = [str(self.tree), *filter(None, [os.environ.get("PYTHONPATH")])]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self._proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tree, env=env
        )
        try:
            self.wait_for_http(self.port, "/v2/health/ready", self.timeout_s, self._proc)
        except Exception:
            print(self.log()[-3000:], file=sys.stderr)
            self.__exit__()
            raise
        self.ready_s = time.perf_counter() - start
        return self

    @staticmethod
    def wait_for_http(port: int, path: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"127.0.0.1:{port}{path} did not answer 200 within {timeout_s:g} s")

    def replica_pid(self, deployment: str) -> int:
        """The PID of a Serve replica of `deployment` (e.g. "ingress") in this server's process tree. Looked for
        during up to 5 s: a worker process renames itself to its actor a moment after it started."""
        deadline = time.monotonic() + 5
        while True:
            for pid in self.processes():
                cmdline = command_line(pid)
                if "ServeReplica" in cmdline and cmdline.split(":")[-1].strip() == deployment:
                    return pid
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        raise RuntimeError(f"no replica of {deployment!r} among the server's processes")

    def process_count(self) -> int:
        return len(descendants(self._proc.pid))

    def rss_mib(self) -> dict[str, float]:
        """Sum of RSS (shared pages counted in every process) and of PSS (shared pages split) over the tree."""
        pids = descendants(self._proc.pid)
        return {field: sum(memory_kib(p, field) for p in pids) / 1024 for field in ("Rss", "Pss")}

    def processes(self) -> list[int]:
        """The server's process and every process below it (Ray's own and the replicas)."""
        return descendants(self._proc.pid) if self._proc is not None else []

    def paused(self):
        """`with server.paused():` the whole process tree stopped, and continued after the block."""
        return paused(self.processes())

    def terminate(self, timeout_s: float = 30, group: bool = False) -> float:
        """SIGTERM to the server process, as `docker stop` sends it, or with `group` to its whole process group, as
        systemd and `timeout` do; seconds until it exited (nan past timeout_s)."""
        if self._proc is not None and self._proc.poll() is None:
            start = time.perf_counter()
            if group:  # started in a session of its own: its process group is its PID
                os.killpg(self._proc.pid, signal.SIGTERM)
            else:
                self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
                self.stop_s = time.perf_counter() - start
            except subprocess.TimeoutExpired:
                pass
        return self.stop_s

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log(self) -> str:
        path = Path(self._dir.name) / "serve.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def __exit__(self, *exc) -> None:
        self.terminate()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)  # whatever of its process group is left
            self._proc.wait(10)
        self._dir.cleanup()
