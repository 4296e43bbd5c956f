"""Waiting for something to become true: a check polled until it passes or a deadline, and the checks waited on
most (a URL answering 200, a model answering a predict). Loopback only. No torch.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable


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


def answers_200(port: int, path: str, proc: subprocess.Popen | None = None) -> bool:
    """Whether GET 127.0.0.1:`port``path` answers 200 (within 2 s); RuntimeError once `proc`, the server that should
    answer, has exited."""
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
    return _answered_200(f"http://127.0.0.1:{port}{path}", 2)


def wait_for_http(port: int, path: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until GET 127.0.0.1:`port``path` answers 200: RuntimeError as soon as `proc` exits, or past `timeout_s`."""
    try:
        until(f"127.0.0.1:{port}{path}", lambda: answers_200(port, path, proc), timeout_s, every_s=0.2, retried=())
    except TimeoutError:
        raise RuntimeError(f"127.0.0.1:{port}{path} did not answer 200 within {timeout_s:g} s") from None


def predicts_ok(port: int, model: str, timeout_s: float = 5) -> bool:
    """Whether one simple-JSON predict to `model` on 127.0.0.1:`port` is answered 200 within `timeout_s`."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models/{model}/predict",
        data=b'{"text": "still answered?"}',
        headers={"Content-Type": "application/json"},
    )
    return _answered_200(request, timeout_s)


def _answered_200(request: str | urllib.request.Request, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):  # HTTPError (a non-2xx) is a URLError
        return False
