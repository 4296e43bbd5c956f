"""`mha-serving quantize`: int8 (or fp16) variants of exported fp32 models, each written only after its quality gate.

Exit status: 0 written (or already there), 1 a conversion failed, 2 a usage error or a model that failed the gate;
every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.decoder_metadata import DecoderMetadata
from contract.metadata import ModelMetadata
from contract.settings import UsageError
from export.cli import file_size
from export.decoder_quantize import (
    DecoderGateSettings,
    DecoderVariantResult,
    decoder_source,
    make_decoder_variant,
)
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
    read_source,
    source_metadata,
    variant_name,
)

PROG = "mha-serving quantize"
EPILOG = """\
The variant is a sibling folder named <model>-<precision> (models/mha-h8-d512 -> models/mha-h8-d512-int8), served
like any other model. The gate compares it with its fp32 source: a trained model on its task's validation split
(accuracy and argmax agreement), any other model on generated inputs (the largest logit difference against the
spread of the fp32 logits; agreement is reported). A decoder (lm-...) is gated on the docs-lm held-out split: its
perplexity against fp32's, and greedy-token agreement with fp32 on prompts of that text. A variant that fails the
gate is not written (exit 2)."""
CLASSIFIER_FLAGS = {"min_agreement", "max_accuracy_drop", "max_relative_diff", "examples"}  # default None: unset
DECODER_FLAGS = {"max_perplexity_ratio", "min_token_agreement", "gate_tokens", "prompts"}


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
    classifier = p.add_argument_group("the gate of a classifier")
    classifier.add_argument("--min-agreement", metavar="X", type=float, help="trained models: argmax agreement (0.99)")
    classifier.add_argument(
        "--max-accuracy-drop",
        metavar="POINTS",
        type=float,
        help="trained models: validation accuracy below fp32's (0.5)",
    )
    classifier.add_argument(
        "--max-relative-diff",
        metavar="X",
        type=float,
        help="other models: max logit diff / spread of fp32 logits (0.25)",
    )
    classifier.add_argument("--examples", metavar="N", type=int, help="generated inputs (512)")
    decoder = p.add_argument_group("the gate of a decoder")
    decoder.add_argument(
        "--max-perplexity-ratio", metavar="X", type=float, help="held-out perplexity / fp32's, at most (1.02)"
    )
    decoder.add_argument(
        "--min-token-agreement", metavar="X", type=float, help="share of greedy tokens equal to fp32's (0.95)"
    )
    decoder.add_argument("--gate-tokens", metavar="N", type=int, help="held-out tokens scored for perplexity (8192)")
    decoder.add_argument("--prompts", metavar="N", type=int, help="prompts of 32 greedy tokens for agreement (8)")
    p.add_argument("--force", action="store_true", help="replace a variant that exists (default: skip it)")
    return p


def _gates(
    args: argparse.Namespace, sources: list[tuple[Path, ModelMetadata | DecoderMetadata]]
) -> tuple[GateSettings, DecoderGateSettings]:
    """Each kind's gate settings; UsageError when a flag is given for a kind of model that no --model is."""
    kinds = {isinstance(meta, DecoderMetadata) for _, meta in sources}
    given = {key for key in CLASSIFIER_FLAGS | DECODER_FLAGS if getattr(args, key) is not None}
    if given & DECODER_FLAGS and False in kinds:
        name = next(meta.name for _, meta in sources if not isinstance(meta, DecoderMetadata))
        raise UsageError(
            f"--{min(given & DECODER_FLAGS).replace('_', '-')} applies to decoders; {name} is a classifier"
        )
    if (given & CLASSIFIER_FLAGS or args.mode != "dynamic") and True in kinds:
        flag = f"--{min(given & CLASSIFIER_FLAGS).replace('_', '-')}" if given & CLASSIFIER_FLAGS else "--mode static"
        name = next(meta.name for _, meta in sources if isinstance(meta, DecoderMetadata))
        raise UsageError(f"{flag} applies to classifiers; {name} is a decoder (its int8 is dynamic, MatMuls only)")
    classifier = GateSettings(**{k: getattr(args, k) for k in CLASSIFIER_FLAGS if getattr(args, k) is not None})
    decoder = {"max_perplexity_ratio": args.max_perplexity_ratio, "min_token_agreement": args.min_token_agreement}
    decoder.update(tokens=args.gate_tokens, prompts=args.prompts)
    return classifier, DecoderGateSettings(**{k: v for k, v in decoder.items() if v is not None})


def _line(result: VariantResult | DecoderVariantResult) -> str:
    size = f"{file_size(result.file_bytes)} ({result.file_bytes / result.source_bytes:.2f} of fp32)"
    return f"{result.name}: passed the gate ({result.gate.summary()}), {size}, {result.seconds:.1f} s"


def _source(folder: Path) -> ModelMetadata | DecoderMetadata:
    """A classifier's or a decoder's metadata, each checked by its own kind's rules."""
    meta = read_source(folder)
    return decoder_source(folder) if isinstance(meta, DecoderMetadata) else source_metadata(folder)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parser().parse_args(argv)
        plan = plan_int8(cpu_flags(), args.reduce_range, args.weights) if args.precision == "int8" else None
        sources = [(folder, _source(folder)) for folder in args.model]  # every folder checked first
        gate, decoder_gate = _gates(args, sources)
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
            if isinstance(meta, DecoderMetadata):
                result = make_decoder_variant(folder, args.precision, args.out, plan=plan, gate=decoder_gate)
            else:
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
