"""The flags of `mha-serving optimize`, checked before anything runs: every mistake is one line (UsageError, exit 2)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from contract.repository import TOKEN_ENV
from contract.settings import UsageError

PROG = "mha-serving optimize"
DESCRIPTION = (
    "From a trained model to the cheapest head configuration that meets an SLO on this machine, measured on the real "
    "serving stack; optionally rolled out on a running service behind a shadow."
)
DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block: main() prints it
        raise UsageError(message)


def parse_budget(text: str) -> float:
    """Seconds from `90s`, `20m`, `1.5h` or a plain number of seconds."""
    match = DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--budget must be a positive duration such as 20m, 90s or 1h, got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def parse_fractions(text: str) -> tuple[float, ...]:
    try:
        fractions = tuple(sorted({float(p) for p in text.split(",") if p.strip()}, reverse=True))
    except ValueError:
        raise UsageError(f"--keep must be comma-separated fractions such as 1,0.75,0.5, got {text!r}") from None
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise UsageError(f"--keep fractions must be within (0, 1], got {text!r}")
    return fractions


def parse_steps(text: str) -> tuple[float, ...]:
    try:
        steps = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise UsageError(f"--rollout-steps must be percentages such as 1,10,50,100, got {text!r}") from None
    if not steps or steps[-1] != 100 or any(not 0 < s <= 100 for s in steps) or list(steps) != sorted(steps):
        raise UsageError(f"--rollout-steps must rise within (0, 100] and end at 100, got {text!r}")
    return steps


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=DESCRIPTION)
    p.add_argument("--model", type=Path, required=True, help="a trained model folder (mha-serving train)")
    p.add_argument("--slo-p99-ms", type=float, help="the p99 latency bar in ms (at --slo-rate, if given)")
    p.add_argument("--slo-rate", type=float, help="the request rate to sustain, requests/s (one sequence each)")
    p.add_argument("--max-accuracy-drop", type=float, default=0.5, help="points, against the model (default 0.5)")
    p.add_argument(
        "--headroom",
        type=float,
        default=0.15,
        help="with --slo-rate: the spare rate a configuration must hold beyond it, as a fraction (default 0.15)",
    )
    p.add_argument("--backend", choices=("cpu", "gpu"), default="cpu", help="where it will serve (default cpu)")
    p.add_argument("--budget", default="20m", help="time for the whole search, e.g. 20m, 90s (default 20m)")
    p.add_argument("--keep", default="1,0.75,0.5,0.25", help="fractions of heads kept (default %(default)s)")
    p.add_argument("--out", type=Path, help="the run's folder (default runs/optimize/<model>); a rerun resumes it")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence of the load (default 32)")
    p.add_argument("--rollout", choices=("shadow",), help="roll the winner out on a running service's route")
    p.add_argument("--route", help="--rollout: the route to roll the winner out on")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="--rollout: the service's URL")
    p.add_argument("--metrics-url", default="http://127.0.0.1:8080/metrics", help="--rollout: its metrics URL")
    p.add_argument(
        "--service-models", type=Path, help="--rollout: the service's models folder (the winner is copied in)"
    )
    p.add_argument("--rollout-steps", default="1,10,50,100", help="--rollout: the winner's share per step, %%")
    p.add_argument("--hold", type=float, default=30.0, help="--rollout: seconds each step is held, at least")
    p.add_argument("--min-agreement", type=float, default=0.99, help="--rollout: live agreement to hold (0.99)")
    args = p.parse_args(argv)
    return checked(args)


def checked(args: argparse.Namespace) -> argparse.Namespace:
    if args.slo_p99_ms is None and args.slo_rate is None:
        raise UsageError("give the SLO: --slo-p99-ms, --slo-rate, or both")
    for flag, value in (("--slo-p99-ms", args.slo_p99_ms), ("--slo-rate", args.slo_rate), ("--hold", args.hold)):
        if value is not None and value <= 0:
            raise UsageError(f"{flag} must be positive, got {value:g}")
    if not 0 <= args.headroom <= 10:
        raise UsageError(f"--headroom must be a fraction of the rate from 0 to 10 (0.15: 15 %), got {args.headroom:g}")
    if args.max_accuracy_drop < 0:
        raise UsageError(f"--max-accuracy-drop must be 0 or more points, got {args.max_accuracy_drop:g}")
    if not (args.model / "model.onnx").is_file():
        raise UsageError(f"--model {args.model} is not an exported model folder (no model.onnx)")
    args.budget_s = parse_budget(args.budget)
    args.keep = parse_fractions(args.keep)
    args.rollout_steps = parse_steps(args.rollout_steps)
    args.out = args.out or Path("runs") / "optimize" / args.model.resolve().name  # beside the sweep's runs/
    if args.rollout:
        if not args.route:
            raise UsageError("--rollout shadow needs --route NAME (the route the winner is rolled out on)")
        if not os.environ.get(TOKEN_ENV):
            raise UsageError(f"--rollout needs the service's repository token in ${TOKEN_ENV}")
    return args
