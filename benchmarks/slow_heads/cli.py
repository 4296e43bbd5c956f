"""`python -m benchmarks.slow_heads`: N connections trickling a request head a line at a time against `mha-serving
serve` (its defaults: limits.header_timeout_s, limits.max_connections) while a probe keeps sending small predicts;
the run and its command line, the JSON and markdown written. Loopback only. No torch."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from pathlib import Path

from benchmarks.harness.processes import fd_count
from benchmarks.harness.server import ServerProcess
from benchmarks.slow_heads.clients import Probe, slow_client
from benchmarks.slow_heads.verdict import AFTER_S, phases, summarize, table, verdicts
from contract.metadata import MODEL_FILE
from service.config import RequestLimits

MACHINE = f"the server, the slow client (a process of its own) and the probe share this machine's {os.cpu_count()} CPUs"


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
