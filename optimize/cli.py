"""`mha-serving optimize`: from a trained model to the cheapest head configuration that meets an SLO here.

Candidates first, accuracy first (heads kept x precision, each through its gate, in a torch process of its own:
`python -m export.candidates_cli`), then the survivors measured on the real serving stack with a search over
serving settings within the budget (optimize/search.py), then one answer (optimize/report.py), optionally rolled
out on a running service behind a shadow (optimize/rollout.py). A rerun with the same --out resumes.

Exit status: 0 a winner (promoted, with --rollout), 1 none meets the SLO (the closest is reported) or the rollout
was rolled back, 2 a usage error (one line).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from contract.repository import DEFAULT_HEADER, TOKEN_ENV
from contract.settings import UsageError
from optimize.arguments import PROG, parse_args
from optimize.measure import MeasurePlan
from optimize.report import Slo, choose, write
from optimize.rollout import RolloutError, RolloutPlan, ServiceAdmin, rollout
from optimize.search import search


def say(line: str) -> None:
    print(f"optimize: {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    status = _candidates(args)
    if status != 0:
        return status
    data = json.loads((args.out / "candidates" / "candidates.json").read_text())
    kept = [c for c in data["candidates"] if c["kept"] and c["folder"]]
    if not kept:
        say(f"no candidate is within {args.max_accuracy_drop:g} points of the model: nothing to measure")
        return 1
    slo = Slo(args.slo_p99_ms, args.slo_rate, args.headroom if args.slo_rate else 0.0)
    budget_left = args.budget_s - (time.monotonic() - started)
    say(f"measuring {len(kept)} candidate(s) on the serving stack for {slo.describe()}, {budget_left:.0f} s left")
    plan = MeasurePlan(seq_len=args.seq_len, backend=args.backend)
    result = search([Path(c["folder"]) for c in kept], slo, plan, args.out, budget_left, progress=say)
    entries = {c["name"]: c for c in data["candidates"]}
    points = [m.point(entries.get(m.candidate)) for m in result.measurements]
    confirmations = {c.point().label: c.point(entries.get(c.candidate)) for c in result.confirmations}
    answer = choose(points, slo, confirmations)
    report = write(args.out, answer, points, slo, _commands(argv, args), args.out / "candidates", args.backend)
    say(f"{answer.why}")
    say(f"report: {report} ({time.monotonic() - started:.0f} s in all, search ended: {result.stopped_by})")
    if answer.winner is None:
        return 1
    say(f"winner: {answer.winner.label}; serve it: mha-serving serve --config {args.out / 'serve.yaml'}")
    return _rollout(args, answer.winner.candidate) if args.rollout else 0


def _candidates(args) -> int:
    """The candidates stage in a process of its own (torch); its lines passed on as progress."""
    cmd = [sys.executable, "-m", "export.candidates_cli", "--model", str(args.model), "--out", str(args.out)]
    cmd += ["--keep", ",".join(f"{k:g}" for k in args.keep), "--backend", args.backend]
    cmd += ["--max-accuracy-drop", f"{args.max_accuracy_drop:g}"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            say(line.rstrip())
        errors = proc.stderr.read().strip().splitlines()
    if proc.returncode == 0:
        return 0
    why = errors[-1] if errors else f"exit status {proc.returncode}"
    print(f"{PROG}: the candidates stage failed: {why}", file=sys.stderr)
    return 2 if proc.returncode == 2 else 1


def _commands(argv: list[str], args) -> list[str]:
    """What reproduces the figures: this run again (it resumes from --out; a fresh --out measures anew) and the
    winner served with its settings."""
    return [
        "mha-serving " + shlex.join(["optimize", *argv]),
        f"mha-serving serve --config {shlex.quote(str(args.out / 'serve.yaml'))}",
    ]


def _rollout(args, winner: str) -> int:
    if args.service_models is not None:
        target = args.service_models / winner
        if not target.exists():
            shutil.copytree(args.out / "winner" / winner, target)
            say(f"rollout: copied {winner} into {args.service_models}")
    admin = ServiceAdmin(args.url, DEFAULT_HEADER, os.environ[TOKEN_ENV])
    plan = RolloutPlan(
        args.route,
        winner,
        steps_pct=args.rollout_steps,
        hold_s=args.hold,
        min_agreement=args.min_agreement,
        slo_p99_ms=args.slo_p99_ms,
    )
    try:
        result = rollout(plan, admin, args.metrics_url, log=say)
    except (RolloutError, httpx.HTTPError) as exc:
        print(f"{PROG}: the rollout stopped: {exc}", file=sys.stderr)
        return 1
    (args.out / "rollout.json").write_text(json.dumps(result.to_json(), indent=2))
    return 0 if result.promoted else 1


if __name__ == "__main__":
    raise SystemExit(main())
