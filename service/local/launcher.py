"""`mha-serving serve`: an embedded local Ray, Serve on host:port, the application from `build_app`, then block.

The process started runs the server in a child of its own (service/local/supervisor.py): Ctrl-C or SIGTERM, to it or
to its process group, drains and shuts Serve and Ray down; SIGHUP reads the config again and applies its routes in
place. Errors a user can fix are one line on stderr and exit code 2. No torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from service.config import AppConfig
from service.errors import ModelFileError
from service.local import ports, supervisor, systemd_unit
from service.local.arguments import (
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    LaunchError,
    load_config,
    parse_args,
    validated,
    within_cores,
)
from service.local.drain import drain_and_stop, stop_ray, stop_signals_interrupt
from service.local.ray_env import import_ray_for_the_server, set_ray_env
from service.local.start_report import report
from service.model_store import find_models
from service.routes import RouteTable
from service.stop_notice import StopNotices

APP_NAME = "mha"
RELOAD_APPLIED_S = 120.0  # every serving process opens the models added (ORT session, warm-up) before it has applied


def cpus_needed(config: AppConfig, names: list[str]) -> float:
    """Logical CPUs Ray must have for every replica: the models in their own deployments, the ingress, Serve."""
    remote = [n for n in names if config.placement_for(n, cluster_gpus=0) == "deployment"]
    per_model = sum(config.settings_for(n).num_cpus * config.settings_for(n).num_replicas for n in remote)
    ingress = config.ingress
    replicas = ingress.process_count() if ingress.on_own_ports else ingress.num_replicas
    return per_model + ingress.num_cpus * replicas + 1  # +1: Serve's controller and proxy


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
    grpc_port: int | None = None  # gRPC: the ingress replica's own port (direct), else Serve's gRPC proxy's; None: none
    processes: int | None = None  # serving processes sharing the ports (direct); None: the config's, or the default


def local_config(config: AppConfig, opts: LocalServe) -> AppConfig:
    """`config` as this server runs it: the ingress listening on the API's address and the gRPC port itself (unless
    through Serve's proxies); LaunchError if the config then does not hold (more than one ingress replica on a port,
    say)."""
    if opts.processes is not None and not opts.direct:
        raise LaunchError("--processes share the ingress's own ports; behind --proxy, set ingress.num_replicas")
    raw = config.model_dump(exclude_unset=True)
    raw["models_dir"] = str(Path(config.models_dir).resolve())  # Serve builds the application in another process
    ingress = {**raw.get("ingress", {}), "host": opts.host, "grpc_port": None}
    if opts.direct:
        ingress.update(port=opts.port, grpc_port=opts.grpc_port, access_log=opts.access_log)
        if opts.processes is not None:
            ingress["processes"] = opts.processes
    raw["ingress"] = ingress
    return within_cores(validated(raw))


def checked(config: AppConfig) -> list[str]:
    """The models `config` serves; LaunchError if one of its routes cannot be served by them."""
    names = find_models(config.models_dir, config.models)
    try:
        RouteTable.build(config.routes, names)
    except ValueError as exc:  # RouteConfigError
        raise LaunchError(f"invalid config: {exc}") from exc
    return names


def start_local(config: AppConfig, opts: LocalServe, notices: StopNotices) -> None:
    """Start an embedded Ray and Serve, and deploy `build_app(config)`, its serving processes connected to
    `notices`; returns once every replica is up."""
    proxied_grpc = not opts.direct and opts.grpc_port is not None
    set_ray_env(opts.host, opts.access_log, config.limits.max_body_bytes if proxied_grpc else None)
    import_ray_for_the_server()
    import ray
    from ray import serve

    names = checked(config)
    num_cpus = opts.num_cpus or max(float(os.cpu_count() or 1), cpus_needed(config, names))
    print(f"mha-serving: starting Ray ({num_cpus:g} logical CPUs) and Serve with {len(names)} model(s)...", flush=True)
    # `_metrics_export_port` is ray.init's documented way to pin the port of the local Prometheus export.
    extra = {} if opts.metrics_port is None else {"_metrics_export_port": opts.metrics_port}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=opts.dashboard,
        configure_logging=False,
        log_to_driver=opts.access_log,
        **extra,
    )
    stop_signals_interrupt()  # after ray.init, which installs its own handler
    if opts.direct:  # the ingress serves the API itself: no proxy, so no second way in
        serve.start(proxy_location="Disabled")
    else:
        from service.rpc.servicers import SERVE_SERVICERS  # gRPC's modules: in the server process only

        grpc = {"port": opts.grpc_port, "grpc_servicer_functions": SERVE_SERVICERS} if proxied_grpc else None
        serve.start(http_options={"host": opts.host, "port": opts.port}, grpc_options=grpc)
    from service import serve_control  # imports Ray: after set_ray_env

    serve_control.deploy(APP_NAME, config, serve_logging(opts), colocated_models(config, names), notices.path)
    serve_control.wait_running(APP_NAME)


def colocated_models(config: AppConfig, names: list[str]) -> dict[str, int]:
    """The models every serving process loads itself (name -> generation, service/repository.py): 0, as at start."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0.0)
    return {name: 0 for name in names if config.placement_for(name, gpus) == "colocated"}


def serve_logging(opts: LocalServe) -> dict:
    return {"enable_access_log": opts.access_log, "log_level": "INFO" if opts.access_log else "WARNING"}


def reload(args: argparse.Namespace, opts: LocalServe, running: AppConfig) -> AppConfig:
    """SIGHUP: the config and the models folder read again, applied in place to every serving process: the routes,
    and the co-located models found in the folder loaded (those gone unloaded; service/repository.py). Requests in
    progress keep their target. A config that does not hold changes nothing; other changes need a restart."""
    try:
        new = local_config(load_config(args), opts)
        names = checked(new)
    except (LaunchError, ModelFileError) as exc:
        print(f"mha-serving serve: reload refused, still serving the previous config: {exc}", file=sys.stderr)
        return running
    others = [k for k in AppConfig.model_fields if k != "routes" and getattr(new, k) != getattr(running, k)]
    if others:
        print(
            f"mha-serving serve: only routes and models change on reload; restart to apply the changes to "
            f"{', '.join(others)}",
            file=sys.stderr,
        )
    from service import serve_control

    deployed = serve_control.deployed_ingress_config(APP_NAME)
    loaded = deployed.get("models") or {}
    wanted = {n: loaded.get(n, 0) for n in colocated_models(running, names)}
    if new.routes == running.routes and wanted == loaded:
        print("mha-serving: reload: the routes and models are unchanged", file=sys.stderr, flush=True)
        return running
    updated = running.model_copy(update={"routes": new.routes})
    routes = serve_control.ingress_user_config(updated)["routes"]
    try:
        serve_control.update_ingress(APP_NAME, {"routes": routes, "models": wanted})
    except Exception as exc:  # Serve's controller refused the config (or is gone): nothing was applied
        print(f"mha-serving serve: reload refused by Serve, still serving the previous config: {exc}", file=sys.stderr)
        return running
    added, gone = sorted(set(wanted) - set(loaded)), sorted(set(loaded) - set(wanted))
    print(
        f"mha-serving: reload: routes {describe_routes(updated)}; models loaded {added or 'none'}, unloaded "
        f"{gone or 'none'}",
        file=sys.stderr,
        flush=True,
    )
    # Serve marks the application deploying until every serving process has reconfigured: until then some
    # processes still answer with the previous routes, so the operator is told when the reload is whole.
    try:
        applied = serve_control.wait_running(APP_NAME, deadline=time.monotonic() + RELOAD_APPLIED_S)
    except RuntimeError as exc:  # a process failed to apply it: the server keeps serving, and says so
        print(f"mha-serving serve: reload failed in a serving process: {_first_reason(exc)}", file=sys.stderr)
        return updated
    if applied:
        print("mha-serving: reload: applied in every serving process", file=sys.stderr, flush=True)
    else:
        print(
            f"mha-serving serve: reload: not every serving process applied it within {RELOAD_APPLIED_S:g} s "
            f"(`serve status` says why)",
            file=sys.stderr,
            flush=True,
        )
    return updated


def describe_routes(config: AppConfig) -> str:
    if not config.routes:
        return "none"
    return "; ".join(f"{name} -> {route.model_dump(exclude_none=True)}" for name, route in config.routes.items())


def main(argv: list[str] | None = None) -> int:
    """Check what a user can fix (exit 2), then run the server in a process of its own under this one (see
    service/local/supervisor.py), or, in that process, serve."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    opts = LocalServe(args.host, args.port, args.metrics_port, not args.proxy, args.num_cpus)
    opts = replace(opts, dashboard=args.dashboard, access_log=args.access_log, grpc_port=args.grpc_port or None)
    opts = replace(opts, processes=args.processes)
    try:
        config = local_config(load_config(args), opts)
        checked(config)
        ports.check_port(args.host, args.port, "HTTP", "--port")
        if args.grpc_port:  # Serve's gRPC proxy binds every interface
            grpc_host = ports.EVERYWHERE if args.proxy else args.host
            ports.check_port(grpc_host, args.grpc_port, "gRPC", "--grpc-port")
        ports.check_port(ports.ray_host(args.host), args.metrics_port, "metrics", "--metrics-port")
    except (LaunchError, ModelFileError, ports.PortError) as exc:
        print(f"mha-serving serve: {exc}", file=sys.stderr)
        return 2
    if not supervisor.is_server():
        if (warning := systemd_unit.stop_warning()) is not None:
            print(warning, file=sys.stderr)
        server = [sys.executable, "-m", __spec__.name, *argv]
        return supervisor.supervise(server, config.limits.drain_s + supervisor.STOP_MARGIN_S)
    supervisor.die_with_supervisor()
    return serve(args, opts, config)


def serve(args: argparse.Namespace, opts: LocalServe, config: AppConfig) -> int:
    """Start, serve until SIGTERM (the supervisor's, for any stop signal), drain, stop; the exit status."""
    hangup = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: hangup.set())  # from the start: SIGHUP's default would end the server
    notices = StopNotices()
    try:
        start_local(config, opts, notices)
        report(args)
        while True:
            if hangup.wait(1.0):
                hangup.clear()
                config = reload(args, opts, config)
    except KeyboardInterrupt:  # SIGTERM (StopSignal), maybe while still starting: the ingress may already be serving
        if ray_started():
            drain_and_stop(APP_NAME, config, notices)
        return 0
    except RuntimeError as exc:  # Serve's deploy failure: a replica raised at start (e.g. backend gpu without one)
        print(f"mha-serving serve: the application failed to start: {_first_reason(exc)}", file=sys.stderr)
        for name, message in _failures().items():
            print(f"  {name}: {_first_reason(RuntimeError(message))}", file=sys.stderr)
        return 1
    finally:
        stop_ray()  # Serve goes with Ray: after `drain`, Serve's own slower shutdown would save nothing
        notices.close()


def _failures() -> dict[str, str]:
    from service.app import failure_reasons

    try:
        return failure_reasons(APP_NAME)
    except Exception:  # Serve itself is gone: nothing more to say than the error above
        return {}


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
