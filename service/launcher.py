"""`mha-serving serve`: an embedded local Ray, Serve on host:port, the application from `build_app`, then block.

Ctrl-C or SIGTERM shuts Serve and Ray down. Errors a user can fix are one line on stderr and exit code 2. No torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from pydantic import ValidationError

from service import http_server, ports
from service.config import AppConfig
from service.drain import drain, stop_ray
from service.errors import ModelFileError
from service.model_store import find_models

APP_NAME = "mha"
DEFAULT_PORT = 8000
DEFAULT_METRICS_PORT = 8080  # Ray's metrics export port: every replica's series on one /metrics URL


# Set in the environment before Ray starts (setdefault: the user's own values win). Measured with
# `python -m service.benchmark` and per-request CPU on 2 cores (README, Serve section):
# - Ray starts its workers at nice 15, so any normal process on the machine (a load generator, a build) starves the
#   replicas; a local server runs them at normal priority.
# - Serve's throughput-optimized mode (user code on the replica's main loop, gRPC between deployments, frozen GC)
#   cut the ingress's CPU per request by about a quarter and raised c=32 throughput by about 20 %.
# - Serve's controller reconciles every 0.1 s, and each pass asks the GCS for the cluster's nodes and resources: idle,
#   the two used ~46 ms of CPU a second, half of Ray's background load. Every 0.5 s they use ~21 (two interleaved
#   rounds of 15 s idle); with nothing to scale on one machine, the slower pass delays only a failed replica's restart.
LOCAL_RAY_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # No Ray started behind the launcher's back: the drain's handle leaves a Serve long-poll client whose late update,
    # arriving while ray.shutdown() tears the driver down, called ray.init() from Ray's own callback thread; shutdown
    # waited on that thread and the server hung until SIGKILL (1 in 5 SIGTERMs under load, py-spy). Without auto-init
    # that call fails at once, and shutdown goes on.
    "RAY_ENABLE_AUTO_CONNECT": "0",
}


# With --access-log: Serve's throughput-optimized mode buffers the request path's log lines 1,000 at a time and
# writes them only to its log files; one at a time, and to stderr too, each request's line reaches the server's
# output as it happens (through Ray's log monitor).
ACCESS_LOG_ENV = {"RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1", "RAY_SERVE_LOG_TO_STDERR": "1"}


def set_local_ray_env(access_log: bool = False) -> None:
    for key, value in {**LOCAL_RAY_ENV, **(ACCESS_LOG_ENV if access_log else {})}.items():
        os.environ.setdefault(key, value)


class LaunchError(RuntimeError):
    """Something the user can fix before the service can start (one line, exit code 2)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mha-serving serve", description=__doc__.splitlines()[0])
    p.add_argument("--models", help="folder with one sub-folder per exported model (default: models, or the config's)")
    p.add_argument("--backend", choices=("auto", "cpu", "gpu"), help="ONNX Runtime backend (default: auto)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the API's address; Ray's own ports stay on loopback unless it is another (default: 127.0.0.1)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default: {DEFAULT_PORT})")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, help="Prometheus port (default: 8080)")
    p.add_argument("--config", type=Path, help="YAML: AppConfig fields, or a Serve config file (its first app's args)")
    p.add_argument("--num-cpus", type=float, help="logical CPUs for the local Ray (default: enough for every replica)")
    p.add_argument("--dashboard", action="store_true", help="start Ray's dashboard too")
    p.add_argument(
        "--proxy",
        action="store_true",
        help="serve through Ray Serve's HTTP proxy (as on a cluster) instead of the ingress replica on --port itself",
    )
    p.add_argument("--access-log", action="store_true", help="log every request (off by default: it costs latency)")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> AppConfig:
    raw: dict = {}
    if args.config is not None:
        try:
            raw = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise LaunchError(f"cannot read config {args.config}: {exc}") from exc
        if "applications" in raw:  # a Serve config file: take the first application's args
            raw = (raw["applications"] or [{}])[0].get("args") or {}
    if args.models is not None:
        raw["models_dir"] = args.models
    if args.backend is not None:
        raw["backend"] = args.backend
    try:
        return AppConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise LaunchError(f"invalid config: {where}: {first['msg']}") from exc


def cpus_needed(config: AppConfig, names: list[str]) -> float:
    """Logical CPUs Ray must have for every replica: the models in their own deployments, the ingress, Serve."""
    remote = [n for n in names if config.placement_for(n, cluster_gpus=0) == "deployment"]
    per_model = sum(config.settings_for(n).num_cpus * config.settings_for(n).num_replicas for n in remote)
    return per_model + config.ingress.num_cpus * config.ingress.num_replicas + 1  # +1: Serve's controller and proxy


MAX_LOCAL_ORT_THREADS = 4  # ORT's intra-op scaling flattens past a few threads at the batch sizes served here


def local_defaults(config: AppConfig, direct: bool) -> AppConfig:
    """What a local server sets where the config is silent (measured: README, Serve section): requests coalesced
    for models in their own deployments, and ORT intra-op threads on every core (up to 4) for each model: on one
    machine the models share the cores, and only a busy model's threads run; one thread for a light model."""
    ingress = {} if "coalesce" in config.ingress.model_fields_set else {"coalesce": True}
    if direct:
        ingress["num_replicas"] = 1  # only one replica can hold the port
    deployment = {}
    if "intra_op_threads" not in config.deployment.model_fields_set:
        deployment["intra_op_threads"] = max(1, min(os.cpu_count() or 1, MAX_LOCAL_ORT_THREADS))
    if "light_model_threads" not in config.deployment.model_fields_set:
        deployment["light_model_threads"] = 1
    return config.model_copy(
        update={
            "ingress": config.ingress.model_copy(update=ingress),
            "deployment": config.deployment.model_copy(update=deployment),
        }
    )


@dataclass(frozen=True)
class LocalServe:
    """How the local Ray and Serve are started (from the CLI flags; the benchmark builds its own)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    metrics_port: int | None = DEFAULT_METRICS_PORT  # None: Ray picks one
    direct: bool = True  # the ingress replica listens on `port` itself; False: through Serve's proxy
    num_cpus: float | None = None  # None: enough logical CPUs for every replica
    dashboard: bool = False
    access_log: bool = False


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's direct ingress, pinned to `port`: HTTP goes straight to the ingress replica, one Ray hop fewer
    than through the proxy (which then listens on a spare port). Read by Serve at import: set before Ray starts."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive: the ingress replica gets exactly `port`
        "RAY_SERVE_PORT_QUARANTINE_S": "0",  # a restarted ingress replica takes the port back at once
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",  # no load balancer to drain from locally
    }


def listen_env(opts: LocalServe) -> None:
    """Set (before Ray starts) where Ray and Serve listen: Ray's ports on loopback for a loopback --host; with direct
    ingress, the ingress replica on --port and Serve's proxy (which Serve keeps, on a spare port) refusing every
    request; the head limits in the proxy (service/http_server.py)."""
    os.environ.update(direct_ingress_env(opts.port) if opts.direct else {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"})
    os.environ.pop(http_server.API_PORT, None)
    if os.environ.get(http_server.FAST_PATH) != "0":  # "0" set by the user: every request through Serve's wrapper
        os.environ[http_server.FAST_PATH] = "1" if opts.direct and not opts.access_log else ""  # Serve logs access
    for key, value in {**ports.ray_env(opts.host), **http_server.proxy_env(opts.port if opts.direct else None)}.items():
        os.environ.setdefault(key, value)


def start_local(config: AppConfig, opts: LocalServe) -> None:
    """Start an embedded Ray and Serve, and deploy `build_app(config)`; returns once every replica is up."""
    listen_env(opts)
    config = local_defaults(config, opts.direct)
    set_local_ray_env(opts.access_log)
    import ray
    from ray import serve

    from service.app import build_app

    names = find_models(config.models_dir, config.models)
    num_cpus = opts.num_cpus or max(float(os.cpu_count() or 1), cpus_needed(config, names))
    print(f"mha-serving: starting Ray ({num_cpus:g} logical CPUs) and Serve with {len(names)} model(s)...", flush=True)
    extra = {} if opts.metrics_port is None else {"_metrics_export_port": opts.metrics_port}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=opts.dashboard,
        configure_logging=False,
        log_to_driver=opts.access_log,
        **extra,
    )
    signal.signal(signal.SIGTERM, _interrupt)  # after ray.init, which installs its own handler
    stop_idle_helpers(opts)
    proxy_port = ports.free_port(opts.host) if opts.direct else opts.port  # the same host: Serve shares it
    serve.start(http_options={"host": opts.host, "port": proxy_port})
    logging = {"enable_access_log": opts.access_log, "log_level": "INFO" if opts.access_log else "WARNING"}
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False, logging_config=logging)


# Processes the embedded Ray starts that a local server does not use, stopped once Ray is up (each one's CPU while
# the service is idle and under load, 2 cores: README, Serve section). Ray's head node watches none of them.
# - the log monitor forwards the workers' log files to the driver's stdout, which happens only with --access-log
#   (log_to_driver); otherwise it globs and reads the log folder ten times a second for no reader (~14 ms of CPU a
#   second). The files themselves are written by the workers either way.
# - the autoscaler's monitor scales a cluster's nodes: one machine has none to add (Serve scales replicas itself).
# The dashboard's head process stays, even without --dashboard: the dashboard agent reports Ray's events (a worker
# that died, say) to it, and logs an error for each batch it cannot report.
IDLE_HELPERS = {"log monitor": "kill_log_monitor", "autoscaler monitor": "kill_monitor"}


def stop_idle_helpers(opts: LocalServe) -> None:
    """Stop the helper processes of IDLE_HELPERS this server does not use."""
    import ray._private.worker

    node = ray._private.worker._global_node
    keep = {"log monitor"} if opts.access_log else set()
    for label, method in IDLE_HELPERS.items():
        if label not in keep and node is not None and hasattr(node, method):
            getattr(node, method)(check_alive=False)


def report(args: argparse.Namespace) -> None:
    import httpx

    base = f"http://{args.host}:{args.port}"
    models = httpx.get(f"{base}/v1/models", timeout=30).json()["models"]
    everywhere = args.host in ("0.0.0.0", "::")  # a URL with it cannot be opened: show loopback, and say so
    shown = "127.0.0.1" if everywhere else args.host
    base = f"http://{shown}:{args.port}"
    print(f"mha-serving: serving on {base}")
    if everywhere:
        print(f"  (listening on every interface, {args.host}: from elsewhere use this machine's name or address)")
    for label, path in [
        ("v2 (Open Inference Protocol)", "/v2/models/{name}/infer"),
        ("simple JSON", "/v1/models/{name}/predict"),
        ("model list", "/v1/models"),
        ("OpenAPI docs", "/docs"),
    ]:
        print(f"  {label:<30} {base}{path}")
    print(f"  {'metrics (Prometheus)':<30} http://{shown}:{args.metrics_port}/metrics")
    for m in models:
        if m["ready"]:
            print(
                f"  model {m['name']}: h={m['heads']} head_dim={m['head_dim']} d_model={m['d_model']} on {m['backend']}"
            )
        else:
            print(f"  model {m['name']}: NOT READY: {m['error']}")
    print("Ctrl-C to stop.", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args)
        find_models(config.models_dir, config.models)
        ports.check_port(args.host, args.port, "HTTP", "--port")
        ports.check_port(ports.ray_host(args.host), args.metrics_port, "metrics", "--metrics-port")
    except (LaunchError, ModelFileError, ports.PortError) as exc:
        print(f"mha-serving serve: {exc}", file=sys.stderr)
        return 2
    try:
        opts = LocalServe(args.host, args.port, args.metrics_port, not args.proxy, args.num_cpus)
        start_local(config, replace(opts, dashboard=args.dashboard, access_log=args.access_log))
        report(args)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, maybe while still starting: the ingress may already be serving
        if ray_started():
            print(f"\nmha-serving: draining (up to {config.limits.drain_s:g} s)...", file=sys.stderr, flush=True)
            left, waited = drain(APP_NAME, config.limits.drain_s)
            unfinished = f", {left} request(s) unfinished" if left > 0 else ""
            print(f"mha-serving: drained in {waited:.1f} s{unfinished}; shutting down", file=sys.stderr, flush=True)
            if not stop_ray():  # Ray's GCS went down with the signal: Ray's own exit hook would wait on it again
                sys.stdout.flush()
                os._exit(0)
        return 0
    except RuntimeError as exc:  # Serve's deploy failure: a replica raised at start (e.g. backend gpu without one)
        print(f"mha-serving serve: the application failed to start: {_first_reason(exc)}", file=sys.stderr)
        for name, message in _failures().items():
            print(f"  {name}: {_first_reason(RuntimeError(message))}", file=sys.stderr)
        return 1
    finally:
        stop_ray()  # Serve goes with Ray: after `drain`, Serve's own slower shutdown would save nothing


def _failures() -> dict[str, str]:
    from service.app import failure_reasons

    try:
        return failure_reasons(APP_NAME)
    except Exception:  # Serve itself is gone: nothing more to say than the error above
        return {}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM shuts down like Ctrl-C


def _first_reason(exc: Exception) -> str:
    """The line of a (Serve) error that says why: our typed errors first, else the first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for marker in ("BackendError:", "ModelFileError:"):
        for line in reversed(lines):
            if marker in line:
                return line[line.index(marker) :]
    return lines[0] if lines else type(exc).__name__


def ray_started() -> bool:
    import ray

    return ray.is_initialized()


if __name__ == "__main__":
    raise SystemExit(main())
