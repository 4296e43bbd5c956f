"""A real `mha-serving serve` process, as a user starts it: from an AppConfig, on free ports, ready when
/v2/health/ready answers 200, measured through /proc (RSS and PSS of its whole process tree), stopped with SIGTERM.
It may serve another checkout's `service` package instead of this one's. Loopback only. No torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.harness.polling import wait_for_http
from benchmarks.harness.processes import command_line, descendants, memory_kib, paused
from service.local.ports import free_port


def takes_grpc_port(tree: Path | None) -> bool:
    """Whether `tree`'s launcher (None: this checkout's) takes --grpc-port: another checkout's may predate gRPC."""
    return tree is None or any('"--grpc-port"' in path.read_text() for path in (tree / "service").rglob("*.py"))


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
        if takes_grpc_port(self.tree):  # both sides of a comparison run the same servers
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
            wait_for_http(self.port, "/v2/health/ready", self.timeout_s, self._proc)
        except Exception:
            print(self.log()[-3000:], file=sys.stderr)
            self.__exit__()
            raise
        self.ready_s = time.perf_counter() - start
        return self

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
        return len(self.processes())

    def rss_mib(self) -> dict[str, float]:
        """Sum of RSS (shared pages counted in every process) and of PSS (shared pages split) over the tree."""
        pids = self.processes()
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
