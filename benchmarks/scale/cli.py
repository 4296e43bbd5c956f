"""`python -m benchmarks.scale`: a model served by 1, 2, 4, ... serving processes on one node, against bare ONNX
Runtime, in one run of interleaved rounds: the command line, the servers, the rounds, the report."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from benchmarks.harness.processes import py_spy, signal_all
from benchmarks.models import MODELS, ensure_model, ensure_variant
from benchmarks.scale import bare as bare_ort
from benchmarks.scale.clients import ClientPool
from benchmarks.scale.figures import summary
from benchmarks.scale.levels import (
    Level,
    default_processes,
    parse_precisions,
    parse_processes,
    parse_variant,
    plan,
)
from benchmarks.scale.report import plot, printed, write_json
from benchmarks.scale.sample import GpuSampler
from benchmarks.scale.servers import level_sides, serve_level, start_all, started, stop_all
from benchmarks.scale.verdict import verdict
from benchmarks.serving.rounds import Side, interleaved, joined, rounds
from contract.metadata import CONFIG_FILE, MODEL_FILE
from service.errors import BackendError
from service.runtime import plan_providers


def parse_args(argv: list[str] | None, cores: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument(
        "--model",
        default="default",
        help="small (h4 d128), default (h8 d512), exported here if missing, or the "
        "name of a model folder in --models (default: default)",
    )
    p.add_argument("--precision", default="fp32", help="fp32, int8, fp16 (GPU) or a list: fp32,fp16 (default: fp32)")
    p.add_argument("--backend", choices=("cpu", "gpu"), default="cpu", help="passed to mha-serving serve")
    p.add_argument(
        "--processes",
        default=",".join(map(str, default_processes(cores))),
        help="serving process counts, one level each (default: powers of two up to the cores: %(default)s)",
    )
    p.add_argument("--clients", type=int, default=max(1, cores // 4), help="load-client processes (%(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="connections per client process (default: 32)")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http", help="v2 infer over HTTP, or gRPC")
    p.add_argument("--body", choices=("json", "binary"), default="json", help="HTTP's request body (default: json)")
    p.add_argument("--seconds", type=float, default=5.0, help="per figure per round (default: 5)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the levels interleaved in each (default: 3)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="also serve every level with these model settings changed (service/config.py DeploymentSettings, e.g. "
        "block:gpu_wait=block), in the same rounds as the defaults; repeatable",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="py-spy one serving process of each level through its loaded windows (without stopping it): its CPU by "
        "stage of the request path (needs py-spy)",
    )
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--plot", type=Path, help="also draw requests/s against processes here (PNG)")
    args = p.parse_args(argv)
    try:
        args.processes = parse_processes(args.processes)
        args.precision = parse_precisions(args.precision, args.backend)
        args.variants = dict(parse_variant(text) for text in args.variant)
        if len(args.variants) < len(args.variant):
            raise ValueError("--variant: each needs a name of its own")
    except ValueError as exc:
        p.error(str(exc))
    if args.profile and not Path(py_spy()).is_file():
        p.error("--profile needs py-spy (pip install py-spy): none on PATH or beside this Python")
    if args.rounds < 1 or args.seconds <= 0 or args.clients < 1 or args.concurrency < 1:
        p.error("--rounds, --clients and --concurrency must be at least 1 and --seconds above 0")
    if args.backend == "gpu":
        try:  # the servers would fail each replica at start, saying why, and be retried by Serve meanwhile
            plan_providers("gpu")
        except BackendError as exc:
            p.error(str(exc))
    if args.model not in MODELS and not (args.models / args.model / MODEL_FILE).is_file():
        p.error(f"--model: {args.model!r} is neither small nor default nor a model in {args.models}")
    return args


def model_names(args) -> dict[str, str]:
    """precision -> the model folder served at it: the model, exported if missing, and its variants."""
    name = args.model
    if name in MODELS:
        d_model, heads, layers = MODELS[name]
        name = ensure_model(args.models, heads, d_model, layers)
    return {p: name if p == "fp32" else ensure_variant(args.models, name, p) for p in args.precision}


def start_servers(stack: contextlib.ExitStack, idle: contextlib.ExitStack, levels: list[Level], names, args):
    """Every level's server, started together, paused (until `idle` closes), each continued in turn while it is
    warmed up."""
    servers = {
        x.label: serve_level(args.models, names[x.precision], args.backend, x.processes, args.variants.get(x.variant))
        for x in levels
    }
    print(
        f"mha-serving serve --processes {','.join(str(x.processes) for x in levels)} --backend {args.backend}...",
        flush=True,
    )
    stack.callback(stop_all, start_all(list(servers.values())))
    for server in servers.values():
        idle.enter_context(server.paused())
    info = {}
    for level in levels:
        server = servers[level.label]
        signal_all(server.processes(), signal.SIGCONT)  # this one runs, the others stay paused
        info[level.label] = started(server, level, names[level.precision])
        signal_all(server.processes(), signal.SIGSTOP)
        answering = len(info[level.label]["answering"])
        print(f"  {level.label}: ready in {server.ready_s:.1f} s, {answering} serving processes answering", flush=True)
    return servers, info


def measured(args, cores: int, names: dict[str, str], levels: list[Level]) -> tuple[dict, dict, dict] | None:
    """The servers started, bare ORT scanned, every side measured in rounds: (the scans per precision, the rounds'
    results by side, the servers' start figures); None when a server did not start (said on stderr)."""
    scans, parts = {}, {}
    with contextlib.ExitStack() as stack:
        with contextlib.ExitStack() as idle:
            try:
                servers, info = start_servers(stack, idle, levels, names, args)
            except (RuntimeError, TimeoutError) as exc:
                why = f"mha-serving serve --backend {args.backend} did not serve (its output above): {exc}"
                print(f"python -m benchmarks.scale: {why}", file=sys.stderr)
                return None
            print(f"bare ORT on {args.backend}: which threads, layout and batch size...", flush=True)
            for precision, name in names.items():
                scans[precision] = bare_ort.scan(args.models, name, args.backend, cores, args.seconds)
        pool = stack.enter_context(ClientPool(args.clients))
        gpu = stack.enter_context(GpuSampler(enabled=args.backend == "gpu"))
        for precision, name in names.items():
            prefix = f"bare {precision}"
            parts[prefix] = bare_ort.sides(args.models, name, args.backend, cores, scans[precision], prefix)
            for level in (x for x in levels if x.precision == precision):
                parts[level.label] = level_sides(pool, servers[level.label], gpu, args, level, name)
        return scans, rounds(announced(interleaved(parts)), args.rounds, args.seconds), info


HEADLINES = (
    ("rate", "{:,.0f} req/s"),
    ("best_rate", "{:,.0f} seq/s"),
    ("c1_p50_ms", "{:.2f} ms"),
    ("p50_ms", "{:.2f} ms"),
)


def announced(sides: dict[str, Side]) -> dict[str, Side]:
    """The same sides, each printing its headline figure once measured: a run of many levels shows progress."""

    def printing(label: str, measure):
        def run(seconds: float) -> dict:
            got = measure(seconds)
            figure = next((fmt.format(got[key]) for key, fmt in HEADLINES if key in got), "")
            print(f"  {label}: {figure}", flush=True)
            return got

        return run

    return {label: (printing(label, measure), server) for label, (measure, server) in sides.items()}


def facts_of(args, cores: int, names: dict[str, str]) -> dict:
    """What the bar's lines and the report need to know of the run; the model by its shape, as its folder says
    (`--model default` and `--model mha-h8-d512` are the same model)."""
    config = json.loads((args.models / next(iter(names.values())) / CONFIG_FILE).read_text())
    return {
        "backend": args.backend,
        "model": (config["heads"], config["d_model"]),
        "precisions": args.precision,
        "processes": args.processes,
        "cores": cores,
        "connections": args.clients * args.concurrency,
        **{k: getattr(args, k) for k in ("rounds", "seconds", "protocol", "clients", "concurrency")},
    }


def main(argv: list[str] | None = None) -> int:
    cores = len(os.sched_getaffinity(0))
    args = parse_args(argv, cores)
    names = model_names(args)
    levels = plan(args.precision, args.processes, ["", *args.variants])
    if (run := measured(args, cores, names, levels)) is None:
        return 1
    scans, got, info = run
    bare = {p: {"scan": scans[p], **joined(got, f"bare {p}")} for p in names}
    by_level = {level.label: joined(got, level.label) for level in levels}
    rows = summary(levels, by_level, bare)
    facts = facts_of(args, cores, names)
    lines = verdict(rows, by_level, facts)
    printed(bare, rows, lines, facts)
    if args.json:
        report = {"settings": vars(args), "facts": facts, "models": names, "servers": info, "bare": bare}
        write_json(args.json, {**report, "levels": rows, "rounds": by_level, "bar": lines})
    if args.plot:
        plot(args.plot, rows)
    return 1 if any(row["errors"] for row in rows.values()) else 0
