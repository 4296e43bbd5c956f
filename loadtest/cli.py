"""`mha-serving loadtest`: bounded load per head configuration against a running service, or `--compare A B`.

Classifiers get requests; decoders (--generate, or when every selected model is one) get streamed completions.

Exit status: 0 all levels measured, 1 some model or level failed, 2 bad input or unreachable service, 130 Ctrl-C.
A report (possibly partial) is written whenever the arguments parse.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from contract.binary_tensors import EXTENSION
from loadtest import kinds, routes, server_metrics
from loadtest.compare import run_compare
from loadtest.discovery import (
    DiscoveryError,
    ModelInfo,
    RemoteURLError,
    check_extension,
    check_loopback,
    discover,
    select_models,
    wait_ready,
)
from loadtest.grpc_client import server_live
from loadtest.progress import Progress
from loadtest.report import ReportError, build_report, write_report
from loadtest.runner import Level, Limits
from loadtest.session import Outcome, Plan, run_session
from loadtest.streams import DEFAULT_GENERATION_PROTOCOL, GENERATION_PROTOCOLS, generation_pb2
from loadtest.workload import PROTOCOLS, SeqLenSpec, WorkloadError, read_texts

PROG = "mha-serving loadtest"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service's base URL (loopback unless allowed)")
    p.add_argument("--allow-remote", action="store_true", help="allow a URL that is not a loopback address")
    p.add_argument("--models", default="all", help="`all` or a comma-separated list of model names")
    p.add_argument(
        "--concurrency", default="1,8,32", help="closed-loop concurrency levels, comma-separated ('' for none)"
    )
    p.add_argument("--rate", default="", help="open-loop Poisson arrival rates in requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured per level (after warm-up)")
    p.add_argument("--max-requests", type=int, default=20000, help="at most this many requests per level")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of unmeasured load before each level")
    p.add_argument("--seq-len", default="fixed:32", help="fixed:N | uniform:LO:HI (tokens, BOS included) | file:PATH")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per request")
    p.add_argument(
        "--protocol",
        default=None,
        help=f"one or several of {', '.join(PROTOCOLS)}, comma-separated: simple JSON, Open Inference v2 over HTTP "
        "(JSON, or binary tensor data) and over gRPC; several take turns at each level (default simple); for "
        f"decoders {', '.join(GENERATION_PROTOCOLS)}: OpenAI completions, OIP generate_stream, the generation RPC "
        f"(default {DEFAULT_GENERATION_PROTOCOL})",
    )
    p.add_argument(
        "--generate",
        action="store_true",
        help="load decoders with streamed completions (the default when every selected model is a decoder)",
    )
    p.add_argument("--prompt-tokens", default="32", help="generation: prompt tokens, BOS included: N or LO:HI")
    p.add_argument("--output-tokens", default="64", help="generation: output tokens (ignore_eos): N or LO:HI")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="generation: goodput's bound on time to first token")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="generation: goodput's bound on every token gap")
    p.add_argument(
        "--grpc-url",
        default="",
        help="host:port of the gRPC service for --protocol grpc (default: --url's host, port 8001)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout in seconds")
    p.add_argument("--max-outstanding", type=int, default=256, help="open loop: cap on requests in flight")
    p.add_argument("--ready-timeout", type=float, default=30.0, help="seconds to wait for a model to be ready")
    p.add_argument("--metrics-url", default="", help="the service's Prometheus URL: adds server-side percentiles")
    p.add_argument(
        "--metrics-name",
        default=None,
        help="server-side latency histogram(s), comma-separated: the first with data for a model is used "
        "(a name ending in _seconds is read as seconds, otherwise milliseconds); default "
        f"{','.join(server_metrics.DEFAULT_METRICS)}, for decoders {','.join(server_metrics.GENERATION_METRICS)} "
        f"(and {','.join(server_metrics.GENERATION_ALSO)} beside it)",
    )
    p.add_argument(
        "--metrics-match",
        action="append",
        default=[],
        metavar="LABEL=VALUE",
        help="only histogram series with this label (repeatable), e.g. application=mha",
    )
    p.add_argument("--metrics-wait", type=float, default=20.0, help="seconds to wait for delayed metric exports")
    p.add_argument("--seed", type=int, default=0, help="seed for texts and arrival times")
    p.add_argument("--out", default="", help="report folder (default reports/<UTC timestamp>/)")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two reports (folders or report.json)")
    return p


def _numbers(text: str, flag: str, kind: type) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a comma-separated list of numbers") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"{flag} {text!r}: every value must be > 0")
    return values


def _label_pairs(items: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = tuple(tuple(item.split("=", 1)) for item in items)
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise ValueError(f"--metrics-match takes LABEL=VALUE, got {items}")
    return pairs  # type: ignore[return-value]


def _levels(args: argparse.Namespace) -> tuple[Level, ...]:
    levels = [Level("closed", c) for c in _numbers(args.concurrency, "--concurrency", int)]
    levels += [Level("open", r) for r in _numbers(args.rate, "--rate", float)]
    if not levels:
        raise ValueError("nothing to run: give --concurrency and/or --rate")
    return tuple(levels)


def _limits(args: argparse.Namespace) -> Limits:
    for flag, value in (("--duration", args.duration), ("--max-requests", args.max_requests)):
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    for flag, value in (("--timeout", args.timeout), ("--max-outstanding", args.max_outstanding)):
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    return Limits(args.duration, args.max_requests, args.warmup, args.timeout, args.max_outstanding)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _meta(args: argparse.Namespace, argv: list[str], plan: Plan) -> dict:
    return {
        "tool": PROG,
        "argv": argv,
        "url": args.url,
        "started_at": _now(),
        "protocol": ",".join(plan.protocols),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "limits": asdict(plan.limits),
        "planned_levels": [lv.label for lv in plan.levels],
        "metrics_url": args.metrics_url,
        "metrics_names": list(plan.metrics_names + plan.metrics_also) if args.metrics_url else [],
        "metrics_match": args.metrics_match,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "models": [],
    }


def _finish(out: Path, meta: dict, outcome: Outcome, message: str) -> str:
    """Write the report with its status; returns the status."""
    measured = any(r.ok > 0 for r in outcome.results)
    if outcome.interrupted:
        status = "interrupted"
    elif outcome.failures or message:
        status = "partial" if measured else "failed"
    else:
        status = "complete"
    meta |= {"status": status, "message": message or "; ".join(outcome.failures), "finished_at": _now()}
    meta["measured"] = f"{len(outcome.results)} level(s), {sum(r.ok for r in outcome.results)} successful requests"
    report = build_report(meta, outcome.results, outcome.notes)
    write_report(out, report, outcome.results, _plots(outcome, out), outcome.streams)
    return status


def _plots(outcome: Outcome, out: Path) -> list[str]:
    """The report's PNG plots, where matplotlib is installed (the `plots` extra; the serving install has none)."""
    try:
        from loadtest.plots import write_plots
    except ModuleNotFoundError as exc:
        print(f"mha-serving loadtest: no plots ({exc.name} missing: pip install 'mha-serving[plots]')", file=sys.stderr)
        return []
    return write_plots(outcome.results, out)


def _discover(args: argparse.Namespace, plan: Plan, outcome: Outcome) -> tuple[Plan, list[ModelInfo]]:
    """The plan for the selected models (classifiers, or decoders: `kinds.settle_kind`) and the models and routes,
    each ready (waiting up to --ready-timeout); those that never get ready are failures. DiscoveryError when the
    service cannot take a protocol asked for."""
    base_url = plan.base_url
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        listing = discover(client, base_url)
        models = select_models(list(listing.models), args.models, listing.routes)
        waiting = [m for m in models if not m.ready]
        late = [m.name for m in waiting if not wait_ready(client, base_url, m, args.ready_timeout)]
        if waiting or any(m.route for m in models):  # a route's configuration is its targets': read once they are up
            listed = discover(client, base_url).by_name()
            models = [listed.get(m.name, m) for m in models]
        plan, models = kinds.settle_kind(args, plan, models, outcome)
        if "v2-binary" in plan.protocols:
            check_extension(client, base_url, EXTENSION, "--protocol v2-binary")
    if plan.grpc_url and (problem := server_live(plan.grpc_url, plan.limits.timeout_s)):
        raise DiscoveryError(
            f"no gRPC service at {plan.grpc_url} for --protocol grpc ({problem}); give --grpc-url the service's "
            "gRPC address (mha-serving serve --grpc-port)"
        )
    if plan.generate and "grpc" in plan.protocols:
        try:
            generation_pb2()
        except WorkloadError as exc:
            raise DiscoveryError(str(exc)) from None
    outcome.failures += [f"{n}: not ready after {args.ready_timeout:g} s; skipped" for n in late]
    unknown = [m.name for m in models if m.route and m.name not in late and not m.measurable]
    outcome.failures += [f"{n}: none of its targets is listed with a configuration; skipped" for n in unknown]
    ready = [m for m in models if m.name not in late and m.measurable]
    if not ready:
        raise DiscoveryError("none of the selected models is ready: " + "; ".join(outcome.failures))
    return plan, ready


async def _drive(plan: Plan, outcome: Outcome, progress: Progress) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        progress.note("interrupted: finishing in-flight requests and writing the report (Ctrl-C again to abort)")
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        await run_session(plan, outcome, stop, progress)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _grpc_address(args: argparse.Namespace) -> str:
    """host:port of the gRPC service: --grpc-url, else --url's host on port 8001; loopback unless allowed."""
    address = args.grpc_url or f"{urlsplit(args.url).hostname or '127.0.0.1'}:8001"
    check_loopback(f"http://{address}", args.allow_remote, flag="--grpc-url")
    return address


def _plan(args: argparse.Namespace) -> Plan:
    """The run's plan from the arguments (models still empty; with no --protocol, no protocols yet:
    `kinds.settle_kind` fills in the kind's default); ValueError names the first bad argument."""
    seq_len = SeqLenSpec.parse(args.seq_len)
    if seq_len.kind == "file":
        read_texts(seq_len.path)
    if args.batch_size < 1:
        raise WorkloadError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.metrics_url:
        check_loopback(args.metrics_url, args.allow_remote)
    protocols, generate = kinds.protocols(args)
    prompt, output, slo = kinds.generation_settings(args)
    if generate and args.batch_size != 1:
        raise WorkloadError(f"--batch-size {args.batch_size}: a generation request is one prompt")
    if args.grpc_url and "grpc" not in protocols:
        raise WorkloadError(f"--grpc-url is for --protocol grpc, and --protocol {args.protocol!r} has no grpc")
    metrics_names = args.metrics_name or ",".join(server_metrics.DEFAULT_METRICS)
    return Plan(
        base_url=check_loopback(args.url, args.allow_remote),
        models=(),
        levels=_levels(args),
        limits=_limits(args),
        seq_len=seq_len,
        batch_size=args.batch_size,
        protocols=protocols,
        grpc_url=_grpc_address(args) if "grpc" in protocols else "",
        metrics_url=args.metrics_url,
        metrics_names=tuple(n.strip() for n in metrics_names.split(",") if n.strip()),
        metrics_match=_label_pairs(args.metrics_match),
        metrics_wait_s=args.metrics_wait,
        seed=args.seed,
        generate=generate,
        prompt_tokens=prompt,
        output_tokens=output,
        slo=slo,
    )


def _compare(args: argparse.Namespace) -> int:
    try:
        print(run_compare(Path(args.compare[0]), Path(args.compare[1]), Path(args.out) if args.out else None))
    except ReportError as exc:
        return _fail(str(exc), 2)
    return 0


def _exit_status(out: Path, meta: dict, outcome: Outcome) -> int:
    status = _finish(out, meta, outcome, "")
    for r in outcome.results:  # a route's share per target is the point of measuring it: said even with --quiet
        if r.is_route:
            print(f"{r.model} {r.protocol} {r.level}: {routes.summary(r)}")
    print(f"report: {out / 'report.md'} ({status}: {meta['measured']})")
    if status == "interrupted":
        return _fail(f"interrupted; wrote what was measured so far to {out}", 130)
    if outcome.failures:
        more = f" (+{len(outcome.failures) - 1} more, see the report)" if len(outcome.failures) > 1 else ""
        return _fail(outcome.failures[0] + more, 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.compare:
        return _compare(args)
    try:
        plan = _plan(args)
    except (ValueError, RemoteURLError) as exc:
        return _fail(str(exc), 2)
    out = Path(args.out or f"reports/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    meta, outcome = _meta(args, argv, plan), Outcome()
    try:
        plan, models = _discover(args, plan, outcome)
        plan = replace(plan, models=tuple(models))
        meta |= kinds.workload_meta(args, plan)
        if plan.generate:  # a classifier's settings, not used
            del meta["seq_len"], meta["batch_size"]
    except DiscoveryError as exc:
        _finish(out, meta, outcome, f"nothing measured: {exc}")
        return _fail(f"{exc} (report: {out})", 2)
    except KeyboardInterrupt:
        outcome.interrupted = True
        _finish(out, meta, outcome, "nothing measured: interrupted while finding the models")
        return _fail(f"interrupted before any load was sent (report: {out})", 130)
    meta["models"] = [m.to_json() for m in plan.models]
    try:
        asyncio.run(_drive(plan, outcome, Progress(quiet=args.quiet)))
    except KeyboardInterrupt:
        outcome.interrupted = True
    return _exit_status(out, meta, outcome)
