"""The candidates stage of `mha-serving optimize` as a command (`python -m export.candidates_cli`), so the torch-free
optimize run can start it in a subprocess: OUT/candidates/ and candidates.json, progress one line at a time, errors
one line on stderr with exit status 2. A rerun resumes: a complete candidates.json is reused, written folders too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.settings import UsageError
from export.candidate_set import DEFAULT_FRACTIONS, CandidateError, CandidateSettings
from export.candidates import CANDIDATES_DIR, make_candidates
from export.quantize import QuantizeError

PROG = "python -m export.candidates_cli"
_DEFAULTS = CandidateSettings()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block: main() prints it
        raise UsageError(message)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--keep must be comma-separated fractions such as 1,0.75,0.5, got {text!r}") from None


def _settings(argv: list[str]) -> tuple[argparse.Namespace, CandidateSettings]:
    p = _Parser(prog=PROG, description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="a trained model folder (mha-serving train)")
    p.add_argument("--out", type=Path, required=True, help=f"the run's folder: candidates go to OUT/{CANDIDATES_DIR}/")
    keep = ",".join(f"{f:g}" for f in DEFAULT_FRACTIONS)
    p.add_argument("--keep", default=keep, help="fractions of heads kept; 1 is always added (%(default)s)")
    p.add_argument("--backend", choices=("cpu", "gpu"), default=_DEFAULTS.backend, help="where it will serve (cpu)")
    p.add_argument("--precision", default="", help="comma-separated (default: fp32 and int8 on cpu, fp16 on gpu)")
    p.add_argument("--max-accuracy-drop", type=float, default=_DEFAULTS.max_drop_points, help="points (0.5)")
    p.add_argument("--min-agreement", type=float, default=_DEFAULTS.min_agreement, help="without labels (0.99)")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="bootstrap and fine-tuning seed (0)")
    p.add_argument("--bootstrap", type=int, default=_DEFAULTS.bootstrap, help="paired resamples (1000)")
    p.add_argument("--finetune-steps", type=int, default=_DEFAULTS.finetune_steps, help="after pruning (none)")
    p.add_argument("--finetune-lr", type=float, default=_DEFAULTS.finetune_lr, help="(3e-4)")
    p.add_argument("--repeats", type=int, default=_DEFAULTS.timing_repeats, help="timed calls at batch 1 (200)")
    p.add_argument("--threads", type=int, default=_DEFAULTS.threads, help="torch and ORT intra-op threads (1)")
    args = p.parse_args(argv)
    settings = CandidateSettings(
        fractions=_floats(args.keep),
        backend=args.backend,
        precisions=tuple(part.strip() for part in args.precision.split(",") if part.strip()),
        max_drop_points=args.max_accuracy_drop,
        min_agreement=args.min_agreement,
        seed=args.seed,
        bootstrap=args.bootstrap,
        finetune_steps=args.finetune_steps,
        finetune_lr=args.finetune_lr,
        timing_repeats=args.repeats,
        threads=args.threads,
    )
    return args, settings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, settings = _settings(argv)
        import torch

        torch.set_num_threads(settings.threads)
        result = make_candidates(args.model, args.out, settings, lambda line: print(line, flush=True))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (UsageError, CandidateError, QuantizeError, ValueError, FloatingPointError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; folders written so far passed their gates: a rerun reuses them", file=sys.stderr)
        return 130
    for c in result.candidates:
        print(f"{'kept   ' if c.kept else 'dropped'} {c.name}: {c.why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
