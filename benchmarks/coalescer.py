"""`python -m benchmarks.coalescer [--versus TREE]`: the ingress coalescer's own cost per request
(service/coalescer.py), with a model deployment's handle that answers at once: requests one at a time, and 32 at
once. This tree's coalescer, and with --versus another checkout's (e.g. `git worktree add /tmp/before <commit>`),
each in a process of its own, measured in turn, round after round. The serving benchmark's deployment scenario
measures the whole path; this measures the part it cannot resolve (a Ray call per group moves its c=1 figures by
milliseconds). No Ray, no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = 32  # requests at once in the loaded figure


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.coalescer", description=__doc__.split("\n\n")[0])
    p.add_argument("--versus", type=Path, metavar="TREE", help="also another checkout's coalescer, in turn")
    p.add_argument("--requests", type=int, default=20_000, help="per figure per round (default: 20,000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one round, in the tree's process
    args = p.parse_args(argv)
    if args.requests < GROUP or args.rounds < 1:
        p.error(f"--requests must be at least {GROUP} and --rounds at least 1")
    return args


async def _loop(requests: int) -> dict[str, float]:
    """Microseconds per request through a Coalescer: one at a time, and GROUP at once."""
    import numpy as np

    from service.batching import BatchResult
    from service.coalescer import Coalescer

    class Call:  # a DeploymentResponse as the coalescer uses it: awaited, or cancelled
        def __init__(self, rows: list[int]) -> None:
            self._rows = rows

        def __await__(self):
            yield from asyncio.sleep(0).__await__()  # answered on the loop's next turn, as a ready answer would be
            return [BatchResult(np.zeros((n, 2), np.float32), n, 0.0, 0.0) for n in self._rows]

        def cancel(self) -> None:
            pass

    class Handle:
        def __init__(self) -> None:
            self.infer_many = self

        def remote(self, group: list) -> Call:
            return Call([ids.shape[0] for ids, _ in group])

    coalescer = Coalescer("m", Handle(), max_rows=GROUP, max_queued=4 * GROUP)
    ids = np.ones((1, 32), np.int64)  # (1, T): one sequence of 32 tokens
    for _ in range(1000):
        await coalescer.infer(ids, ids)
    start = time.perf_counter()
    for _ in range(requests):
        await coalescer.infer(ids, ids)
    one = (time.perf_counter() - start) / requests
    groups = requests // GROUP
    start = time.perf_counter()
    for _ in range(groups):
        await asyncio.gather(*(coalescer.infer(ids, ids) for _ in range(GROUP)))
    many = (time.perf_counter() - start) / (groups * GROUP)
    return {"c=1 us": one * 1e6, f"{GROUP} at once us": many * 1e6}


def measured(tree: Path, requests: int) -> dict[str, float]:
    """One round in a process importing `tree`'s service package."""
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", "--requests", str(requests)]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(asyncio.run(_loop(args.requests))))
        return 0
    trees = {"this": ROOT, **({"versus": args.versus} if args.versus else {})}
    got: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for round_ in range(args.rounds):
        for label in trees if round_ % 2 == 0 else reversed(trees):  # the order alternates: drift cancels
            got[label].append(measured(trees[label], args.requests))
    print(f"coalescer, microseconds per request (median of {args.rounds} rounds of {args.requests} requests):")
    for label, rounds in got.items():
        figures = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        print(f"  {label:<7} {trees[label]}: " + ", ".join(f"{key} {value:.1f}" for key, value in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
