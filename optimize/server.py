"""A candidate served as a user serves it: `mha-serving serve` started as a subprocess with a generated config on
free loopback ports, ready once /v2/health/ready answers 200, stopped with SIGTERM and checked to exit. Imports
nothing of service/ (the server is a program here, not a library). No torch.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from optimize.settings import ServingSettings

LOOPBACK = "127.0.0.1"
# Chosen here, bound later by the server: above Ray's worker ports (10002-19999) and below the kernel's ephemeral
# range, where a socket bound to port 0 meanwhile could take it (service/local/ports.py keeps the same range).
PORT_RANGE = (20000, 32767)
_handed_out: set[int] = set()  # never the same port twice from this process: a server binds its ports late
STOP_TIMEOUT_S = 30.0  # the drain (optimize/settings.py DRAIN_S) and Ray's shutdown, with room on 2 busy cores


class ServeError(RuntimeError):
    """The server could not be run for a measurement; one line saying why."""


class PortInUseError(ServeError):
    """A port chosen for the server was taken before it bound it (another program got there first)."""


class ServerStartError(ServeError):
    """The server exited, or was not ready in time; `reason` is what it said last on stderr."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Stopped:
    exit_status: int | None  # None: it had to be killed
    seconds: float  # from SIGTERM to its exit


def free_port() -> int:
    """A loopback port that can be bound now, outside the kernel's ephemeral range where there is room."""
    try:
        low_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low_ephemeral = 32768
    high = min(PORT_RANGE[1], low_ephemeral - 1)
    for port in random.sample(range(PORT_RANGE[0], high + 1), min(200, max(0, high + 1 - PORT_RANGE[0]))):
        if port in _handed_out:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((LOOPBACK, port))
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's choice
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def serve_command() -> str:
    """The `mha-serving` program installed beside this Python (a venv run unactivated), else on PATH."""
    beside = Path(sys.executable).parent / "mha-serving"
    found = str(beside) if beside.is_file() else shutil.which("mha-serving")
    if not found:
        raise ServeError("the mha-serving program is neither beside this Python nor on PATH: install the project")
    return found


class Server:
    """`with Server(folder, settings, workdir) as server:` the model in `folder` served alone with `settings` on
    `server.base_url`; the config and the server's stdout and stderr are kept in `workdir`."""

    def __init__(
        self, folder: Path, settings: ServingSettings, workdir: Path, backend: str = "cpu", ready_timeout_s: float = 180
    ) -> None:
        self.folder, self.settings, self.workdir = Path(folder), settings, Path(workdir)
        self.backend, self.ready_timeout_s = backend, ready_timeout_s
        self.port = 0
        self.ready_s = float("nan")
        self.stopped: Stopped | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def stderr_path(self) -> Path:
        return self.workdir / "serve.stderr"

    def __enter__(self) -> Server:
        try:
            self.start()
        except PortInUseError:  # lost a race for a port: once more, on others
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until it is ready; PortInUseError or ServerStartError (it is stopped then)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "serve.yaml"
        config.write_text(yaml.safe_dump(self.settings.serve_config(self.folder, self.backend), sort_keys=False))
        self.port, self.stopped = free_port(), None
        command = [serve_command(), "serve", "--config", str(config), "--port", str(self.port), "--grpc-port", "0"]
        command += ["--metrics-port", str(free_port())]
        started = time.monotonic()
        with open(self.workdir / "serve.stdout", "wb") as out, open(self.stderr_path, "wb") as err:
            # a session of its own: whatever it leaves behind can be ended as one process group
            self._proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
        try:
            self._wait_ready(started)
        except BaseException:  # Ctrl-C too: a server that never became ready is not left running
            self.stop()
            raise
        self.ready_s = time.monotonic() - started

    def _wait_ready(self, started: float) -> None:
        deadline = started + self.ready_timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                status = self._proc.poll()
                if status is not None:
                    reason = self.last_words()
                    if "is in use" in reason:
                        raise PortInUseError(reason)
                    raise ServerStartError(f"the server exited with status {status} before it was ready", reason)
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/v2/health/ready").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"the server was not ready within {self.ready_timeout_s:g} s", self.last_words()
                    )
                time.sleep(0.25)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> Stopped | None:
        """SIGTERM (a drain), then the exit awaited; killed, with its process group, past `timeout_s`."""
        proc = self._proc
        if proc is None or self.stopped is not None:
            return self.stopped
        started = time.monotonic()
        status: int | None = proc.poll()
        if status is None:
            proc.send_signal(signal.SIGTERM)
            try:
                status = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                # killed with its whole session (Ray's processes) while its leader still holds the group's id
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.stopped = Stopped(status, round(time.monotonic() - started, 3))
        return self.stopped

    def last_words(self) -> str:
        """Why the server stopped, as it said it: its own error line (and the lines after it) or stderr's last."""
        try:
            lines = [line.strip() for line in self.stderr_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        ours = [i for i, line in enumerate(lines) if line.startswith("mha-serving serve:")]
        said = " ".join(lines[ours[-1] :]) if ours else (lines[-1] if lines else "(nothing on stderr)")
        return said[:500]
