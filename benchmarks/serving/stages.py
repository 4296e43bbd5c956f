"""CPU per request by stage of the request path: py-spy samples of the ingress replica under load, each attributed to
the innermost stage it recognises; each thread's CPU (/proc) split by its own samples' stages. `python -m
benchmarks.serving --profile` runs it; `python -m benchmarks.serving.stages FILE` reads a py-spy raw file (`py-spy
record -f raw`)."""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.harness.processes import cpu_seconds, py_spy, thread_cpu
from benchmarks.harness.server import ServerProcess
from benchmarks.serving.requests import request_bodies
from benchmarks.serving.rounds import WARMUP_S
from loadtest.http_client import LoadResult, load, post_bytes

# (stage, pattern on a frame "function (file:line)"), innermost match wins; order breaks ties within a frame.
STAGES: list[tuple[str, re.Pattern]] = [
    ("ORT run", re.compile(r"Session\.run|service/runtime\.py")),
    ("metrics", re.compile(r"ray/util/metrics\.py|ray/serve/metrics\.py|service/metrics\.py")),
    ("JSON encode", re.compile(r"service/responses\.py|orjson|json/encoder")),
    ("JSON decode + validation", re.compile(r"pydantic|service/protocol/|service/validation\.py|parse_body|_body ")),
    ("batching", re.compile(r"service/batching\.py|service/engine\.py|concurrent/futures")),
    ("handler", re.compile(r"service/ingress\.py|service/placement\.py|service/http/")),
    ("FastAPI / Starlette", re.compile(r"fastapi/|starlette/")),
    ("Serve replica", re.compile(r"ray/serve/")),
    ("HTTP server (uvicorn, event loop)", re.compile(r"uvicorn/|asyncio/|threading\.py")),
    ("Ray worker", re.compile(r"ray/")),
]
OTHER = "other"
UNSAMPLED = "native threads (no Python frame: Ray's, gRPC's, ORT's)"
THREAD = re.compile(r"^thread \((\d+)\)")  # py-spy --threads: a stack's first frame names its thread
# A sample whose innermost frame is one of these is a thread waiting, not working: py-spy counts a waiting thread as
# active from its wake-up until it runs again (runnable, waiting for a core), which on busy cores is long.
WAITING = re.compile(r"^(_worker \(concurrent/futures/thread\.py|\w+\.wait \(threading\.py)")


def classify(frames: list[str]) -> str:
    """The stage of one sample: the innermost frame (last in py-spy's order) that some stage recognises."""
    for frame in reversed(frames):
        for stage, pattern in STAGES:
            if pattern.search(frame):
                return stage
    return OTHER


def thread_stages(raw: str) -> dict[int | None, Counter[str]]:
    """py-spy raw output (`frame;frame;... count` per line; recorded with --threads, the first frame names the
    thread: `thread (TID): NAME`) -> thread id (None without --threads) -> stage -> samples."""
    counts: dict[int | None, Counter[str]] = {}
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not (stack and n.isdigit()):
            continue
        frames = stack.split(";")
        tid = None
        if named := THREAD.match(frames[0]):
            tid, frames = int(named.group(1)), frames[1:]
        if not (frames and WAITING.match(frames[-1])):
            counts.setdefault(tid, Counter())[classify(frames)] += int(n)
    return counts


def stage_shares(raw: str, thread_cpu_s: dict[int, float] | None = None) -> dict[str, float]:
    """Stage -> share of the process's CPU. With `thread_cpu_s` (each thread's CPU seconds over the recording, by
    thread id, of a recording with --threads), each thread's CPU is split by its own samples' stages, so a thread
    seldom running weighs what it used, not how often py-spy saw it; a thread that used CPU with no working sample
    (no Python frame: Ray's, gRPC's and ORT's own threads) counts as UNSAMPLED. Without it, the samples' shares. A
    sample of a thread waiting (WAITING) counts nowhere."""
    weighted: Counter[str] = Counter()
    per_thread = thread_stages(raw)
    if thread_cpu_s:
        for tid, cpu_s in thread_cpu_s.items():
            samples = per_thread.get(tid)
            if not samples:
                weighted[UNSAMPLED] += cpu_s
                continue
            n = sum(samples.values())
            for stage, k in samples.items():
                weighted[stage] += cpu_s * k / n
    else:
        for samples in per_thread.values():
            weighted.update(samples)
    total = sum(weighted.values()) or 1
    return {stage: weighted[stage] / total for stage in [s for s, _ in STAGES] + [OTHER, UNSAMPLED] if weighted[stage]}


def table(shares: dict[str, float], cpu_ms_per_request: float | None = None) -> str:
    lines = [f"{'stage':<36} {'share':>6}" + ("  CPU/request" if cpu_ms_per_request else "")]
    for stage, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        cost = f"  {share * cpu_ms_per_request * 1e3:7.0f} us" if cpu_ms_per_request else ""
        lines.append(f"{stage:<36} {share * 100:5.1f}%{cost}")
    if cpu_ms_per_request:
        lines.append(f"{'total':<36} {100:5.1f}%  {cpu_ms_per_request * 1e3:7.0f} us")
    return "\n".join(lines)


def start_recording(pid: int, seconds: float, rate: int = 200) -> tuple[subprocess.Popen, Path]:
    """py-spy sampling process `pid` `rate` times a second for `seconds` (at least 1) without stopping it, into a raw
    file; OSError if there is no py-spy."""
    raw = Path(tempfile.mkdtemp(prefix="mha-profile-")) / "py-spy.txt"
    cmd = [py_spy(), "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", str(rate), "-f", "raw"]
    cmd += ["--threads", "-o", str(raw), "--nonblocking"]  # --threads: each sample names its thread (stage_shares)
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return spy, raw


def recorded_shares(spy: subprocess.Popen, raw: Path, thread_cpu_s: dict[int, float] | None = None) -> dict[str, float]:
    """A recording's stage shares (stage_shares) once py-spy has ended; empty if it failed (it says why on
    stderr)."""
    _, err = spy.communicate(timeout=60)
    if not raw.is_file():
        print(f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}", file=sys.stderr)
        return {}
    return stage_shares(raw.read_text(), thread_cpu_s)


def loaded_stages(port: int, name: str, seconds: float, concurrency: int, pid: int) -> dict:
    """Process `pid`'s CPU per request by stage (py-spy) while one model is served at c=`concurrency` for `seconds`;
    empty if py-spy failed (it says why on stderr)."""
    requests = [post_bytes(f"/v2/models/{name}/infer", b) for b in request_bodies(64)]
    load(port, requests, concurrency, WARMUP_S)
    spy, raw = start_recording(pid, seconds)
    cpu_before, threads_before = cpu_seconds(pid), thread_cpu(pid)
    loaded: LoadResult = load(port, requests, concurrency, seconds)
    cpu_ms = (cpu_seconds(pid) - cpu_before) * 1e3 / max(1, loaded.requests + loaded.errors)
    threads = {tid: cpu_s - threads_before.get(tid, 0.0) for tid, cpu_s in thread_cpu(pid).items()}
    shares = recorded_shares(spy, raw, threads)
    return {"cpu_ms_per_request": cpu_ms, "shares": shares} if shares else {}


def profiled(server: ServerProcess, names: dict[str, str], args, run: dict, others: list) -> None:
    """--profile: each model measured once more with py-spy on the ingress (others paused); its stages into `run`."""
    pid = server.replica_pid("ingress")
    with contextlib.ExitStack() as stack:
        for other in others:
            stack.enter_context(other.paused())
        for label, name in names.items():
            if stages := loaded_stages(server.port, name, args.seconds, args.concurrency, pid):
                run[label]["stages"] = stages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.stages", description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path, help="py-spy raw output (py-spy record -f raw)")
    p.add_argument("--cpu-ms", type=float, help="the process's CPU per request, to turn shares into microseconds")
    args = p.parse_args(argv)
    print(table(stage_shares(args.raw.read_text()), args.cpu_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
