"""The flags of `mha-serving serve` and the AppConfig they and `--config` make; a config that does not hold is one
line (LaunchError). Imports no Ray. No torch.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import yaml
from pydantic import ValidationError

from contract.repository import DEFAULT_HEADER, TOKEN_ENV
from service.config import INGRESS_NAME, AppConfig, default_processes

DESCRIPTION = (
    "`mha-serving serve`: an embedded local Ray, Serve on host:port, the application from `build_app`, then block."
)
DEFAULT_PORT = 8000
DEFAULT_GRPC_PORT = 8001  # Triton's gRPC port; KServe's is 8081
DEFAULT_METRICS_PORT = 8080  # Ray's metrics export port: every replica's series on one /metrics URL
MIN_TOKEN_CHARS = 16


class LaunchError(RuntimeError):
    """Something the user can fix before the service can start (one line, exit code 2)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mha-serving serve", description=DESCRIPTION)
    p.add_argument("--models", help="folder with one sub-folder per exported model (default: models, or the config's)")
    p.add_argument("--backend", choices=("auto", "cpu", "gpu"), help="ONNX Runtime backend (default: auto)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the API's address; Ray's own ports stay on loopback unless it is another (default: 127.0.0.1)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default: {DEFAULT_PORT})")
    p.add_argument(
        "--grpc-port",
        type=int,
        default=DEFAULT_GRPC_PORT,
        help="Open Inference Protocol gRPC and grpc.health.v1 port, served by the ingress replica (with --proxy: by "
        f"Serve's gRPC proxy, on every interface); 0: no gRPC (default: {DEFAULT_GRPC_PORT})",
    )
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, help="Prometheus port (default: 8080)")
    p.add_argument("--config", type=Path, help="YAML: AppConfig fields, or a Serve config file (its first app's args)")
    p.add_argument("--num-cpus", type=float, help="logical CPUs for the local Ray (default: enough for every replica)")
    p.add_argument("--dashboard", action="store_true", help="start Ray's dashboard too")
    p.add_argument(
        "--proxy",
        action="store_true",
        help="serve through Ray Serve's HTTP and gRPC proxies (as on a cluster) instead of the ingress replica on "
        "--port and --grpc-port itself",
    )
    p.add_argument("--access-log", action="store_true", help="log every request (off by default: it costs latency)")
    p.add_argument(
        "--processes",
        type=_positive,
        help="serving processes sharing --port and --grpc-port, each with its own co-located models (default: the "
        "config's ingress.processes, else one per two cores)",
    )
    p.add_argument(
        "--repository",
        action="store_true",
        help=f"serve the model repository API (/v2/repository/...: load, unload, index), its token read from "
        f"${TOKEN_ENV} (at least {MIN_TOKEN_CHARS} characters); requests must carry it in the header named by "
        f"repository.header (default {DEFAULT_HEADER})",
    )
    return p.parse_args(argv)


def repository_settings(raw: dict) -> dict:
    """The config's `repository` turned on, with the token from the environment (only its digest is kept)."""
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < MIN_TOKEN_CHARS:
        state = "is not set" if not token else f"has {len(token)} characters"
        raise LaunchError(
            f"--repository needs a token of at least {MIN_TOKEN_CHARS} characters in ${TOKEN_ENV}; it {state}"
        )
    digest = hashlib.sha256(token.encode()).hexdigest()
    return {**(raw.get("repository") or {}), "enabled": True, "token_sha256": digest}


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {text!r}")
    return int(text)


def load_config(args: argparse.Namespace) -> AppConfig:
    raw: dict = {}
    if args.config is not None:
        try:
            raw = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise LaunchError(f"cannot read config {args.config}: {exc}") from exc
        if "applications" in raw:  # a Serve config file: the first application's args, and the ingress's routes
            app = (raw["applications"] or [{}])[0]
            raw = dict(app.get("args") or {})
            for deployment in app.get("deployments") or []:
                if deployment.get("name") == INGRESS_NAME and "routes" in (deployment.get("user_config") or {}):
                    raw["routes"] = deployment["user_config"]["routes"]
    if args.models is not None:
        raw["models_dir"] = args.models
    if args.backend is not None:
        raw["backend"] = args.backend
    if args.repository:
        raw["repository"] = repository_settings(raw)
    return validated(raw)


def validated(raw: dict) -> AppConfig:
    try:
        return AppConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise LaunchError(f"invalid config: {where + ': ' if where else ''}{message}") from exc


def within_cores(config: AppConfig) -> AppConfig:
    """`config`, if its serving processes on the ingress's own ports fit this machine: at most one per core. Each is
    a Python process with its own engines; past one per core they only contend (and a typo of a few zeros would
    start thousands)."""
    cores = len(os.sched_getaffinity(0))
    if config.ingress.on_own_ports and (processes := config.ingress.process_count()) > cores:
        raise LaunchError(
            f"{processes} serving processes (--processes, ingress.processes) on this machine's {cores} cores: at most "
            f"one per core (the default is one per two cores: {default_processes(cores)})"
        )
    return config
