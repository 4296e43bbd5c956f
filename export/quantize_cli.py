"""`mha-serving quantize`: int8 (or fp16) variants of exported fp32 models, each written only after its quality gate.

Exit status: 0 written (or already there), 1 a conversion failed, 2 a usage error or a model that failed the gate;
every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.settings import UsageError
from export.cli import file_size
from export.quantize import (
    MODES,
    REDUCE_RANGE,
    VARIANT_PRECISIONS,
    WEIGHT_TYPES,
    GateError,
    GateSettings,
    QuantizeError,
    VariantResult,
    cpu_flags,
    make_variant,
    plan_int8,
    source_metadata,
    variant_name,
)

PROG = "mha-serving quantize"
EPILOG = """\
The variant is a sibling folder named <model>-<precision> (models/mha-h8-d512 -> models/mha-h8-d512-int8), served
like any other model. The gate compares it with its fp32 source: a trained model on its task's validation split
(accuracy and argmax agreement), any other model on generated inputs (the largest logit difference against the
spread of the fp32 logits; agreement is reported). A variant that fails the gate is not written (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block: main() prints it
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, epilog=EPILOG, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        metavar="FOLDER",
        action="append",
        required=True,
        type=Path,
        help="an exported fp32 model folder (repeat for several)",
    )
    p.add_argument("--out", metavar="DIR", type=Path, help="where the variants go (default: beside each model)")
    p.add_argument("--precision", choices=VARIANT_PRECISIONS, default="int8", help="int8 (CPU) or fp16 (GPU)")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="dynamic",
        help="int8: dynamic (activations quantized per run; default) or static (calibrated on generated inputs)",
    )
    p.add_argument(
        "--reduce-range",
        choices=REDUCE_RANGE,
        default="auto",
        help="int8: 7-bit weights; auto turns it on where the CPU has no VNNI",
    )
    p.add_argument("--weights", choices=WEIGHT_TYPES, default="s8", help="int8 weight type (default: s8)")
    p.add_argument(
        "--min-agreement", metavar="X", type=float, default=0.99, help="gate, trained models: argmax agreement (0.99)"
    )
    p.add_argument(
        "--max-accuracy-drop",
        metavar="POINTS",
        type=float,
        default=0.5,
        help="gate, trained models: validation accuracy below fp32's (0.5)",
    )
    p.add_argument(
        "--max-relative-diff",
        metavar="X",
        type=float,
        default=0.25,
        help="gate, other models: max logit diff / spread of fp32 logits (0.25)",
    )
    p.add_argument("--examples", metavar="N", type=int, default=512, help="gate: generated inputs (512)")
    p.add_argument("--force", action="store_true", help="replace a variant that exists (default: skip it)")
    return p


def _line(result: VariantResult) -> str:
    size = f"{file_size(result.file_bytes)} ({result.file_bytes / result.source_bytes:.2f} of fp32)"
    return f"{result.name}: passed the gate ({result.gate.summary()}), {size}, {result.seconds:.1f} s"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parser().parse_args(argv)
        gate = GateSettings(
            max_accuracy_drop=args.max_accuracy_drop,
            min_agreement=args.min_agreement,
            max_relative_diff=args.max_relative_diff,
            examples=args.examples,
        )
        plan = plan_int8(cpu_flags(), args.reduce_range, args.weights) if args.precision == "int8" else None
        sources = [(folder, source_metadata(folder)) for folder in args.model]  # every folder checked first
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (UsageError, ValueError, QuantizeError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if plan is not None:
        print(f"int8: {plan.weights} weights, reduce_range {'on' if plan.reduce_range else 'off'} ({plan.reason})")
    for folder, meta in sources:
        name = variant_name(meta.name, args.precision)
        if ((args.out or folder.parent) / name).exists() and not args.force:
            print(f"{name}: exists, skipped (--force replaces it)", flush=True)
            continue
        print(f"{name}: {args.precision} from {folder} ...", flush=True)
        try:
            result = make_variant(folder, args.precision, args.out, mode=args.mode, plan=plan, gate=gate)
        except GateError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        except (QuantizeError, OSError) as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted; no half-written model folder was left behind", file=sys.stderr)
            return 130
        print(_line(result), flush=True)
    return 0
