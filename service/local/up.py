"""`mha-serving up`: export the default head configurations and train the first decoder if missing, then serve.

The export and the training run as subprocesses (`mha-serving export`, `mha-serving train`), so torch never enters
the serving process. No torch.
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
# The first decoder, trained on the docs corpus so that the first run answers a completion with words of the docs.
# Measured on 2 cores (one thread trains): 300 steps take 60 s and babble (perplexity 7.8); 600 take ~100 s of CPU
# and write docs-like words and phrases (perplexity 5.3).
LM_HEADS, LM_KV_HEADS, LM_D_MODEL, LM_LAYERS, LM_STEPS = 4, 1, 64, 2, 600
DECODER = config_name(LM_HEADS, LM_D_MODEL, prefix="lm", kv_heads=LM_KV_HEADS)  # lm-h4-kv1-d64


def missing_models(models_dir: Path) -> list[str]:
    names = [config_name(h, D_MODEL) for h in DEFAULT_HEADS]
    return [n for n in names if not (models_dir / n / MODEL_FILE).is_file()]


def decoder_missing(models_dir: Path) -> bool:
    return not (models_dir / DECODER / MODEL_FILE).is_file()


def export_command(models_dir: Path) -> list[str]:
    heads = ",".join(str(h) for h in DEFAULT_HEADS)
    cmd = [sys.executable, "-m", "service.cli", "export", "--heads", heads, "--d-model", str(D_MODEL)]
    return [*cmd, "--layers", str(LAYERS), "--out", str(models_dir)]


def train_command(models_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "service.cli", "train", "--task", "docs-lm", "--heads", str(LM_HEADS)]
    cmd += ["--kv-heads", str(LM_KV_HEADS), "--d-model", str(LM_D_MODEL), "--layers", str(LM_LAYERS)]
    return [*cmd, "--steps", str(LM_STEPS), "--out", str(models_dir)]


def export_defaults(models_dir: Path) -> int:
    cmd = export_command(models_dir)
    print(f"mha-serving up: exporting the default head configurations: {' '.join(cmd[2:])}", flush=True)
    return subprocess.call(cmd)


def train_decoder(models_dir: Path) -> int:
    cmd = train_command(models_dir)
    print(f"mha-serving up: training the first decoder (about 2 min): {' '.join(cmd[2:])}", flush=True)
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mha-serving up",
        description=__doc__.splitlines()[0],
        epilog="Every other option is passed to `mha-serving serve` (see its --help).",
    )
    p.add_argument("--models", type=Path, default=Path("models"), help="models folder (default: models)")
    p.add_argument("--no-decoder", action="store_true", help=f"do not train the first decoder ({DECODER}) if missing")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    missing = missing_models(args.models)
    if missing:
        print(f"mha-serving up: missing {', '.join(missing)} in {args.models}", flush=True)
        code = export_defaults(args.models)
        if code != 0:
            print(f"mha-serving up: export failed (exit status {code}); not starting the service", file=sys.stderr)
            return code
    if not args.no_decoder and decoder_missing(args.models):
        print(f"mha-serving up: missing {DECODER} in {args.models}", flush=True)
        code = train_decoder(args.models)
        if code != 0:
            print(f"mha-serving up: training failed (exit status {code}); not starting the service", file=sys.stderr)
            return code
    return launcher.main(["--models", str(args.models), *rest])


if __name__ == "__main__":
    raise SystemExit(main())
