"""CPU per request by stage of the request path: py-spy samples of the ingress replica, each attributed to the
innermost stage it recognises, scaled by the replica's CPU time per request (from /proc).

Used by `python -m benchmarks.serving --profile`; `python -m benchmarks.stage_profile FILE` reads a py-spy raw file
(`py-spy record -f raw`). No torch.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# (stage, pattern on a frame "function (file:line)"), innermost match wins; order breaks ties within a frame.
STAGES: list[tuple[str, re.Pattern]] = [
    ("ORT run", re.compile(r"Session\.run|service/runtime\.py")),
    ("metrics", re.compile(r"ray/util/metrics\.py|ray/serve/metrics\.py|service/metrics\.py")),
    ("JSON encode", re.compile(r"service/responses\.py|orjson|json/encoder")),
    ("JSON decode + validation", re.compile(r"pydantic|service/protocol/|service/validation\.py|parse_body|_body ")),
    ("batching", re.compile(r"service/batching\.py|service/engine\.py|concurrent/futures")),
    ("handler", re.compile(r"service/ingress\.py|service/placement\.py|service/http/")),
    ("FastAPI / Starlette", re.compile(r"fastapi/|starlette/")),
    ("Serve replica", re.compile(r"ray/serve/")),
    ("HTTP server (uvicorn, event loop)", re.compile(r"uvicorn/|asyncio/|threading\.py")),
    ("Ray worker", re.compile(r"ray/")),
]
OTHER = "other"


def classify(frames: list[str]) -> str:
    """The stage of one sample: the innermost frame (last in py-spy's order) that some stage recognises."""
    for frame in reversed(frames):
        for stage, pattern in STAGES:
            if pattern.search(frame):
                return stage
    return OTHER


def stage_shares(raw: str) -> dict[str, float]:
    """py-spy raw output (`frame;frame;... count` per line) -> stage -> share of the samples."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if stack and n.isdigit():
            counts[classify(stack.split(";"))] += int(n)
    total = sum(counts.values()) or 1
    return {stage: counts[stage] / total for stage in [s for s, _ in STAGES] + [OTHER] if counts[stage]}


def table(shares: dict[str, float], cpu_ms_per_request: float | None = None) -> str:
    lines = [f"{'stage':<36} {'share':>6}" + ("  CPU/request" if cpu_ms_per_request else "")]
    for stage, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        cost = f"  {share * cpu_ms_per_request * 1e3:7.0f} us" if cpu_ms_per_request else ""
        lines.append(f"{stage:<36} {share * 100:5.1f}%{cost}")
    if cpu_ms_per_request:
        lines.append(f"{'total':<36} {100:5.1f}%  {cpu_ms_per_request * 1e3:7.0f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stage_profile", description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path, help="py-spy raw output (py-spy record -f raw)")
    p.add_argument("--cpu-ms", type=float, help="the process's CPU per request, to turn shares into microseconds")
    args = p.parse_args(argv)
    print(table(stage_shares(args.raw.read_text()), args.cpu_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
