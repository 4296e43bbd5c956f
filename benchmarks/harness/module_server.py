"""A benchmark's own server (`python -m MODULE ... --port P`) in a subprocess, as one side of the rounds: ready once
its /docs answers, paused while the other sides are measured."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.harness.polling import wait_for_http
from benchmarks.harness.processes import paused
from service.local.ports import free_port


class ModuleServer:
    """`with ModuleServer(module, args, ready_timeout_s) as s:` serves on `s.port` until the block ends."""

    def __init__(self, module: str, args: list[str], ready_timeout_s: float) -> None:
        self.port = free_port()
        self._ready_timeout_s = ready_timeout_s
        self._proc = subprocess.Popen([sys.executable, "-m", module, *args, "--port", str(self.port)])

    def __enter__(self):
        try:
            wait_for_http(self.port, "/docs", self._ready_timeout_s, self._proc)
        except Exception:
            self.__exit__()
            raise
        return self

    def paused(self):
        return paused([self._proc.pid])

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        self._proc.wait(10)
