"""`python -m benchmarks.slow_heads`: N connections trickling a request head a line at a time against `mha-serving
serve` (its defaults: limits.header_timeout_s, limits.max_connections), while a probe client keeps sending small
predict requests on one kept-alive connection: when each slow connection is closed, the probe's latency before,
during and after, and the ingress replica's descriptors. Loopback only. No torch.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import resource
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from itertools import count
from pathlib import Path

import numpy as np

from benchmarks.harness.processes import fd_count
from benchmarks.harness.server import ServerProcess
from contract.metadata import MODEL_FILE
from service.config import RequestLimits

AFTER_S = 3.0  # the descriptors are counted this long after the last slow connection was closed (the bar's "after")
CONNECTING = 512  # connects in flight at once: under the listen backlog (2048), so no handshake waits on a full queue
CLOSED = ("408", "503", "bare close", "reset")  # closed by the server
MACHINE = f"the server, the slow client (a process of its own) and the probe share this machine's {os.cpu_count()} CPUs"


def outcome(answer: bytes) -> str:
    """What the server did with a slow head, from all it sent before its close: "408", "503", "bare close", or
    "other" (any other answer)."""
    if not answer:
        return "bare close"
    status = answer[9:12].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else ""
    return status if status in ("408", "503") else "other"


async def _slow_head(port: int, line_every_s: float, give_up_s: float, connecting: asyncio.Semaphore):
    """One connection sending a request line, then a header line every `line_every_s`, until the server closes:
    (outcome, monotonic time of its first byte, seconds from it to the close)."""
    async with connecting:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return "connect failed", float("nan"), float("nan")
    start = time.monotonic()
    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n")

    async def trickle() -> None:
        for i in count():
            await asyncio.sleep(line_every_s)
            writer.write(b"X-Slow-%d: v\r\n" % i)

    trickling = asyncio.create_task(trickle())
    answer = b""
    try:
        async with asyncio.timeout(give_up_s):
            while chunk := await reader.read(65536):
                answer += chunk
        result = outcome(answer)
    except TimeoutError:
        result = "still open"
    except ConnectionError:
        result = "reset"
    seconds = time.monotonic() - start
    trickling.cancel()
    writer.close()
    return result, start, seconds


def slow_client(port: int, n: int, line_every_s: float, give_up_s: float) -> dict:
    """Run in a process of its own: n slow heads at once; their records and the descriptor limit it ran under."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, n + 1024)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))

    async def all_of_them() -> list:
        connecting = asyncio.Semaphore(CONNECTING)
        return await asyncio.gather(*(_slow_head(port, line_every_s, give_up_s, connecting) for _ in range(n)))

    begin = time.monotonic()
    records = asyncio.run(all_of_them())
    return {"begin": begin, "end": time.monotonic(), "nofile": target, "records": records}


class Probe(threading.Thread):
    """A small predict request every `every_s` on one kept-alive connection (a new one after a failure); each
    sample: (monotonic start, seconds, or None for a failure: an error, a timeout, a status other than 200)."""

    def __init__(self, port: int, model: str, every_s: float) -> None:
        super().__init__(daemon=True)
        self.port, self.path, self.every_s = port, f"/v1/models/{model}/predict", every_s
        self.samples: list[tuple[float, float | None]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        body, headers = json.dumps({"text": "still answered?"}).encode(), {"Content-Type": "application/json"}
        conn, next_at = None, time.monotonic()
        while not self.stopping.is_set():
            start = time.monotonic()
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("POST", self.path, body, headers)
                response = conn.getresponse()
                response.read()
                seconds = time.monotonic() - start if response.status == 200 else None
            except (OSError, http.client.HTTPException):
                conn.close()
                conn, seconds = None, None
            self.samples.append((start, seconds))
            next_at = max(next_at + self.every_s, time.monotonic())
            self.stopping.wait(next_at - time.monotonic())
        if conn is not None:
            conn.close()


def latency(samples: list[tuple[float, float | None]]) -> dict:
    """Requests, failures, and p50 / p99 / max in ms of the answered ones."""
    ms = np.array([s for _, s in samples if s is not None]) * 1e3
    out = {"requests": len(samples), "failures": sum(s is None for _, s in samples)}
    for key, value in (("p50_ms", 50), ("p99_ms", 99), ("max_ms", 100)):
        out[key] = float(np.percentile(ms, value)) if len(ms) else float("nan")
    return out


def phases(samples: list[tuple[float, float | None]], begin: float, end: float) -> dict[str, dict]:
    """The probe's latency before the first slow connection, while any was open, and after the last was closed."""
    return {
        "before": latency([s for s in samples if s[0] < begin]),
        "during": latency([s for s in samples if begin <= s[0] <= end]),
        "after": latency([s for s in samples if s[0] > end]),
    }


def probe_ok(phase: dict) -> bool:
    """A phase of the probe within the bar: p99 under 100 ms, and no request failed (a failure has no latency)."""
    return phase["p99_ms"] < 100 and phase["failures"] == 0


def verdicts(result: dict) -> dict[str, bool]:
    """Each line of the bar, from a run's result (the dict `main` writes as JSON)."""
    slow, probe, fds = result["slow"], result["probe"], result["fds"]
    return {
        "closed in time": slow["closed_in_time"] == slow["n"],
        "probe p99 < 100 ms": all(map(probe_ok, probe.values())),
        "fds back to idle": fds["after"] <= fds["idle_max"],
    }


def table(result: dict) -> str:
    """The one table: printed, and the markdown report's body."""
    slow, fds, ok = result["slow"], result["fds"], verdicts(result)
    mark = {True: "**pass**", False: "**FAIL**"}
    outcomes = ", ".join(f"{k}: {v:,}" for k, v in slow["outcomes"].items())
    rows = [
        "| what | measured | bar |",
        "| --- | --- | --- |",
        f"| slow heads closed within header_timeout_s + 1 s ({slow['limit_s']:g} s) | {slow['closed_in_time']:,} of "
        f"{slow['n']:,} ({outcomes}); first byte to close p50 {slow['p50_s']:.2f} s, max {slow['max_s']:.2f} s "
        f"| all: {mark[ok['closed in time']]} |",
    ]
    for phase, p in result["probe"].items():
        rows.append(
            f"| probe {phase} ({p['requests']:,} requests) | p50 {p['p50_ms']:.1f} ms, p99 {p['p99_ms']:.1f} ms, max "
            f"{p['max_ms']:.1f} ms; {p['failures']} failures | p99 < 100 ms, none failed: "
            f"{mark[probe_ok(p)]} |"
        )
    rows.append(
        f"| ingress replica descriptors | idle {fds['idle_min']:,}-{fds['idle_max']:,} (over {fds['idle_s']:g} s), "
        f"peak {fds['peak']:,}, {AFTER_S:g} s after the last close {fds['after']:,} "
        f"| back to idle: {mark[ok['fds back to idle']]} |"
    )
    return "\n".join(rows)


def summarize(run: dict, limit_s: float) -> dict:
    """The slow connections' figures: outcomes, how many closed within `limit_s` of their first byte, times."""
    records = run["records"]
    times = np.array([s for result, _, s in records if result in CLOSED])
    return {
        "n": len(records),
        "limit_s": limit_s,
        "closed_in_time": int(sum(result in CLOSED and s <= limit_s for result, _, s in records)),
        "outcomes": dict(Counter(result for result, _, _ in records)),
        "p50_s": float(np.median(times)) if len(times) else float("nan"),
        "max_s": float(times.max()) if len(times) else float("nan"),
        "each": [(result, round(s, 4)) for result, _, s in records],  # outcome, first byte to close (s)
    }


def measure(args: argparse.Namespace, limits: RequestLimits) -> dict:
    """One run: the server started, the probe alone for `args.calm` s, the slow heads from a process of their own,
    then AFTER_S more; the ingress replica's descriptors counted every 0.1 s throughout."""
    print(f"mha-serving serve, {args.model} alone...", flush=True)
    config = {"models_dir": str(args.models.resolve()), "models": [args.model]}
    with ServerProcess(config) as server, ProcessPoolExecutor(1, multiprocessing.get_context("spawn")) as pool:
        pid = server.replica_pid("ingress")
        pool.submit(int).result()  # the client process started and ready before the clock runs
        probe = Probe(server.port, args.model, args.probe_every)
        probe.start()
        print(f"probe alone for {args.calm:g} s, then {args.connections:,} slow heads...", flush=True)
        idle, deadline = [], time.monotonic() + args.calm
        while time.monotonic() < deadline:
            idle.append(fd_count(pid))
            time.sleep(0.1)
        give_up_s = limits.header_timeout_s + 10
        running = pool.submit(slow_client, server.port, args.connections, args.line_every, give_up_s)
        peak, shown = max(idle), time.monotonic()
        while not running.done():
            peak = max(peak, fds := fd_count(pid))
            if time.monotonic() - shown >= 2:
                print(f"  ingress replica descriptors: {fds:,}", flush=True)
                shown = time.monotonic()
            time.sleep(0.1)
        run = running.result()
        time.sleep(max(0.0, run["end"] + AFTER_S - time.monotonic()))
        after = fd_count(pid)
        probe.stopping.set()
        probe.join()
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": MACHINE,
        "settings": {**vars(args), "header_timeout_s": limits.header_timeout_s, "nofile": run["nofile"]},
        "slow": summarize(run, limits.header_timeout_s + 1),
        "probe": phases(probe.samples, run["begin"], run["end"]),
        "fds": {"idle_s": args.calm, "idle_min": min(idle), "idle_max": max(idle), "peak": peak, "after": after},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slow_heads", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument("--model", default="mha-h4-d128", help="the one model served, light so the probe measures HTTP")
    p.add_argument("--connections", type=int, default=3000, help="slow connections, opened at once (default: 3000)")
    p.add_argument("--line-every", type=float, default=2.0, help="seconds between a slow head's lines (default: 2)")
    p.add_argument("--probe-every", type=float, default=0.02, help="seconds between probe requests (default: 0.02)")
    # The replica connects to Ray's dashboard agent (metrics export) some 8-9 s after the server is ready, for good:
    # the idle range is taken over long enough to include that descriptor.
    p.add_argument("--calm", type=float, default=15.0, help="seconds of probe alone before (default: 15)")
    p.add_argument("--out", type=Path, default=Path("runs/slow-heads"), help="where the JSON and markdown go")
    args = p.parse_args(argv)
    if args.connections < 1 or min(args.line_every, args.probe_every, args.calm) <= 0:
        p.error("--connections must be at least 1 and --line-every, --probe-every, --calm above 0")
    if not (args.models / args.model / MODEL_FILE).is_file():
        p.error(f"no {args.model} in {args.models} (`python -m benchmarks.serving` exports mha-h4-d128 there)")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and args.connections + 64 > hard:
        print(f"{args.connections:,} connections exceed the hard descriptor limit ({hard:,}): some will not open")
    limits = RequestLimits()
    print(f"{MACHINE}; header_timeout_s {limits.header_timeout_s:g} s, max_connections {limits.max_connections}")
    result = measure(args, limits)
    result["verdicts"] = verdicts(result)
    text = table(result)
    print(f"\n{text}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"slow-heads-{args.connections}-{datetime.now():%Y%m%d-%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    command = " ".join(["python -m benchmarks.slow_heads", *(sys.argv[1:] if argv is None else argv)])
    stem.with_suffix(".md").write_text(f"# Slow request heads, {result['date']}\n\n`{command}`; {MACHINE}.\n\n{text}\n")
    print(f"\nwrote {stem}.json and .md")
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
