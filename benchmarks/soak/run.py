"""`python -m benchmarks.soak`: `mha-serving serve` with the five default models under a long mixed load at a share of
its measured capacity, sampled every few seconds, then a report and a verdict against issue 28's soak bar: the run
itself (the client started, the samples taken, the report's head) and its command line. Loopback only. No torch."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from benchmarks.harness.exposition import export_url
from benchmarks.harness.server import ServerProcess
from benchmarks.soak.load import PROTOCOLS, SEQ_LEN, Plan, Tally, intervals, run_client
from benchmarks.soak.report import Samples, classes, client_row, thread_names_text, write_figures, write_report
from benchmarks.soak.sample import TreeSampler
from benchmarks.soak.verdict import verdict, windows
from contract.metadata import CONFIG_FILE, MODEL_FILE, config_name
from contract.settings import DEFAULT_HEADS

DEFAULT_MODELS = tuple(config_name(h, 512) for h in DEFAULT_HEADS)  # what `make run` serves
MACHINE = f"the server and the load client (a process of its own) share this machine's {os.cpu_count()} CPUs"
SHORT_S = 1800.0  # shorter runs say that their verdict is a smoke
PROGRESS_EVERY_S = 60.0  # a progress line this often (every sample when samples are further apart)


class SoakError(RuntimeError):
    """The run cannot go on: the client found no capacity, or stopped answering."""


@dataclass
class Run:
    """What a run measured so far: a row per sample, each row's valid latencies by model, the answers."""

    rows: list[dict] = field(default_factory=list)
    latencies: list[dict[str, np.ndarray]] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)
    slow_ms: list[float] = field(default_factory=list)
    dropped: int = 0
    capacity: float = float("nan")
    rate: float = float("nan")
    interrupted: str = ""
    thread_names: list[dict[str, Counter]] = field(default_factory=list)  # per kind, at the load's start and end

    def add(self, row: dict, tally: Tally | None) -> None:
        self.rows.append(row)
        self.latencies.append(
            {m: np.array(v, dtype=np.float32) for m, v in (tally.latencies_ms if tally else {}).items()}
        )
        if tally is not None:
            self.outcomes.update(tally.outcomes)
            self.slow_ms += tally.slow_ms
            self.dropped += tally.dropped


def next_message(messages, client: multiprocessing.Process, timeout_s: float) -> tuple:
    """The client's next message; SoakError if it exits or says nothing for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            message = messages.get(timeout=1.0)
        except queue.Empty:
            if not client.is_alive():
                raise SoakError(f"the load client exited (status {client.exitcode})") from None
            continue
        if message[0] == "error":
            raise SoakError(message[1])
        return message
    raise SoakError(f"the load client said nothing for {timeout_s:g} s")


def progress(row: dict) -> str:
    return (
        f"  {row['t_s']:6.0f} s  RSS {row['rss_mib']:,.0f} MiB  PSS {row['pss_mib']:,.0f} MiB  ingress fds "
        f"{row['ingress_fds']:.0f} threads {row['ingress_threads']:.0f}  {row.get('rate_ok', 0):.0f} ok/s  p99 "
        f"{row.get('all_p99_ms', float('nan')):.1f} ms  5xx {row.get('5xx', 0)}  /metrics "
        f"{row['metrics_bytes'] / 1e3:,.0f} kB {row['metrics_series']:,.0f} series {row['metrics_scrape_s']:.2f} s"
    )


def soak(server: ServerProcess, plan: Plan, samples: Samples, run: Run) -> None:
    """Start the client, wait for its capacity, then sample every `plan.sample_s` until the load ends."""
    context = multiprocessing.get_context("spawn")
    messages, stop = context.Queue(), context.Event()
    client = context.Process(target=run_client, args=(plan, messages, stop), name="soak-client", daemon=True)
    client.start()
    names = [name for name, _ in plan.models]
    try:
        sampler = TreeSampler(server.processes()[0], client.pid, export_url(server.metrics_port))
        print(f"capacity: closed loop c={plan.concurrency} over the mix's valid requests for {plan.capacity_s:g} s...")
        _, run.capacity, run.rate, t0 = next_message(messages, client, plan.capacity_s + 120)
        print(
            f"capacity {run.capacity:.1f} requests/s; offering {run.rate:.1f}/s for {plan.duration_s:g} s", flush=True
        )
        last = intervals(plan.duration_s, plan.sample_s)
        every = max(1, round(PROGRESS_EVERY_S / plan.sample_s))
        for k in range(last + 1):
            t_s = min(k * plan.sample_s, plan.duration_s)
            time.sleep(max(0.0, t0 + t_s - time.monotonic()))
            row = {"t_s": t_s, **sampler.sample()}
            tally = None
            if k > 0:
                _, got, tally = next_message(messages, client, plan.timeout_s + 30)
                if got != k:
                    raise SoakError(f"the load client sent interval {got} where {k} was due")
                row.update(client_row(tally, names, t_s - run.rows[-1]["t_s"]))
            if k in (0, last):  # which threads a kind gained or lost over the run, by name
                run.thread_names.append(sampler.thread_names())
            run.add(row, tally)
            samples.add(row)
            if k % every == 0 or k == last:
                print(progress(row), flush=True)
    except KeyboardInterrupt:
        run.interrupted = "interrupted (Ctrl-C)"
    except SoakError as exc:
        run.interrupted = str(exc)
    finally:
        stop.set()
        client.join(plan.timeout_s + 5)
        if client.is_alive():
            client.terminate()


def head(command: str, started: str, server: ServerProcess, plan: Plan, run: Run) -> str:
    """The report's first lines: what ran, on what, and how the load was made."""
    mix = plan.mix
    text = [
        f"# Soak run, {started}",
        f"`{command}`; {MACHINE}.",
        f"Served: {', '.join(n for n, _ in plan.models)} by `mha-serving serve` with its defaults (ready in "
        f"{server.ready_s:.1f} s). Capacity: a closed loop of c={plan.concurrency} over the valid requests for "
        f"{plan.capacity_s:g} s, {run.capacity:.1f} requests/s; offered {plan.fraction:g} x that, {run.rate:.1f} "
        f"requests/s of Poisson arrivals, for {plan.duration_s:g} s, sampled every {plan.sample_s:g} s. The mix: "
        f"valid requests to every model alike through {', '.join(PROTOCOLS)} ({SEQ_LEN.low}-{SEQ_LEN.high} tokens), "
        f"{mix.invalid:.0%} invalid (bad JSON, unknown model, too long, over HTTP and gRPC: 4xx expected), "
        f"{mix.disconnect:.0%} early disconnects (closed before the answer), a slow client (its body over ~1 s) "
        f"every {mix.slow_every_s:g} s.",
    ]
    if run.interrupted:
        text.append(f"**Cut short at {run.rows[-1]['t_s']:g} s: {run.interrupted}.** The windows are of what ran.")
    if run.rows[-1]["t_s"] < SHORT_S:
        text.append(
            f"A run under {SHORT_S / 60:g} minutes is a smoke of the whole: over so short a fit the memory slope is "
            "mostly noise (the bar is for an hour)."
        )
    return "\n\n".join(text)


def model_max_len(models_dir: Path, name: str) -> int:
    return int(json.loads((models_dir / name / CONFIG_FILE).read_text())["max_len"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument(
        "--model",
        action="append",
        help=f"a model to serve, repeatable (default: the five default ones, {', '.join(DEFAULT_MODELS)}, exported "
        "into --models if missing)",
    )
    p.add_argument("--fraction", type=float, default=0.7, help="of the measured capacity (default: 0.7)")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of load (default: 3600)")
    p.add_argument("--sample", type=float, default=10.0, help="seconds between samples (default: 10)")
    p.add_argument("--capacity-seconds", type=float, default=5.0, help="of the capacity's closed loop (default: 5)")
    p.add_argument("--out", type=Path, help="where the report goes (default: runs/soak/<date-time>/)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.fraction <= 1:
        p.error(f"--fraction must be in (0, 1], got {args.fraction:g}")
    if args.sample <= 0 or args.capacity_seconds <= 0:
        p.error("--sample and --capacity-seconds must be above 0")
    if args.duration < 6 * args.sample:
        p.error(f"--duration must be at least 6 x --sample ({6 * args.sample:g} s): its windows are a sixth of it")
    if args.model is None:
        from service.local.up import export_defaults, missing_models  # `make run`'s export, when a model is missing

        if missing_models(args.models) and export_defaults(args.models) != 0:
            p.error(f"could not export the default models into {args.models}")
        args.model = list(DEFAULT_MODELS)
    missing = [m for m in args.model if not (args.models / m / MODEL_FILE).is_file()]
    if missing:
        p.error(f"no {', '.join(missing)} in {args.models}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path("runs/soak") / f"{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    models = tuple((m, model_max_len(args.models, m)) for m in args.model)
    plan = Plan(0, 0, models, args.fraction, args.duration, args.sample, args.capacity_seconds, seed=args.seed)
    print(f"{MACHINE}. mha-serving serve with {', '.join(args.model)} (its defaults, own free ports)...", flush=True)
    samples, run = Samples(out / "samples.csv", list(args.model)), Run()
    config = {"models_dir": str(args.models.resolve()), "models": list(args.model)}
    started = datetime.now().isoformat(timespec="seconds")
    with ServerProcess(config) as server:
        print(f"ready in {server.ready_s:.1f} s, {server.process_count()} processes", flush=True)
        plan = replace(plan, port=server.port, grpc_port=server.grpc_port)
        soak(server, plan, samples, run)
    samples.close()
    if len(run.rows) < 2:
        print(f"no interval was measured: {run.interrupted or 'the run ended early'}", file=sys.stderr)
        return 1
    lines = verdict(run.rows, run.latencies, dict(classes(run.outcomes)))
    figures = write_figures(run.rows, list(args.model), windows(run.rows[-1]["t_s"]), out)
    command = " ".join(["python -m benchmarks.soak", *(sys.argv[1:] if argv is None else argv)])
    text = write_report(
        out / "report.md",
        head(command, started, server, plan, run),
        lines,
        run.rows,
        run.latencies,
        list(args.model),
        (run.outcomes, run.slow_ms, run.dropped),
        figures,
        thread_names_text(run.thread_names[0], run.thread_names[-1]) if run.thread_names else "Not sampled.",
    )
    print("\n" + text.split("## Summary")[0].strip())
    print(f"\nwrote {out}/report.md, samples.csv and {len(figures)} PNGs")
    return 0 if all(x.ok for x in lines) and not run.interrupted else 1
