"""Copy deploy/serve_config.yaml into the RayService's `serveConfigV2`, verbatim, after you edit it.

`python deploy/k8s/embed_serve_config.py` rewrites only that block; `--check` exits 1 (saying so) when they differ.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[1]
SERVE_CONFIG = DEPLOY / "serve_config.yaml"
RAYSERVICE = DEPLOY / "k8s" / "base" / "rayservice.yaml"
BLOCK = re.compile(r"^(?P<indent> *)serveConfigV2: \|\n(?P<body>(?:(?P=indent) {2}.*\n|\n)*)", re.M)


def embedded(rayservice: str, serve_config: str) -> str:
    """`rayservice` with its serveConfigV2 block replaced by `serve_config`, indented under the key."""
    match = BLOCK.search(rayservice)
    if match is None:
        raise ValueError(f"no `serveConfigV2: |` block in {RAYSERVICE}")
    pad = match["indent"] + "  "
    body = "".join(pad + line if line.strip() else "\n" for line in serve_config.splitlines(keepends=True))
    return rayservice[: match.start("body")] + body + rayservice[match.end("body") :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the RayService is up to date")
    args = parser.parse_args(argv)
    current = RAYSERVICE.read_text()
    wanted = embedded(current, SERVE_CONFIG.read_text())
    if wanted == current:
        print(f"{RAYSERVICE.name}: serveConfigV2 matches {SERVE_CONFIG.name}")
        return 0
    if args.check:
        print(f"{RAYSERVICE.name}: serveConfigV2 differs from {SERVE_CONFIG.name}; run {__file__}", file=sys.stderr)
        return 1
    RAYSERVICE.write_text(wanted)
    print(f"{RAYSERVICE.name}: serveConfigV2 updated from {SERVE_CONFIG.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
