"""`mha-serving up`: export the default head configurations into --models if any is missing, then serve them.

The export runs as a subprocess (`mha-serving export`), so torch never enters the serving process. No torch.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from contract.metadata import MODEL_FILE, config_name
from contract.settings import DEFAULT_HEADS
from service.local import launcher

D_MODEL, LAYERS = 512, 4  # the default set: d_model 512, h in DEFAULT_HEADS, 4 layers


def missing_models(models_dir: Path) -> list[str]:
    names = [config_name(h, D_MODEL) for h in DEFAULT_HEADS]
    return [n for n in names if not (models_dir / n / MODEL_FILE).is_file()]


def export_defaults(models_dir: Path) -> int:
    heads = ",".join(str(h) for h in DEFAULT_HEADS)
    cmd = [sys.executable, "-m", "service.cli", "export", "--heads", heads, "--d-model", str(D_MODEL)]
    cmd += ["--layers", str(LAYERS), "--out", str(models_dir)]
    print(f"mha-serving up: exporting the default head configurations: {' '.join(cmd[2:])}", flush=True)
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mha-serving up",
        description=__doc__.splitlines()[0],
        epilog="Every other option is passed to `mha-serving serve` (see its --help).",
    )
    p.add_argument("--models", type=Path, default=Path("models"), help="models folder (default: models)")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    missing = missing_models(args.models)
    if missing:
        print(f"mha-serving up: missing {', '.join(missing)} in {args.models}", flush=True)
        code = export_defaults(args.models)
        if code != 0:
            print(f"mha-serving up: export failed (exit status {code}); not starting the service", file=sys.stderr)
            return code
    return launcher.main(["--models", str(args.models), *rest])


if __name__ == "__main__":
    raise SystemExit(main())
