"""`mha-serving export`: one ONNX model folder per head configuration, each written only after the parity gate.

Exit status: 0 exported (or already there), 1 an export failed, 2 a usage error; every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from contract.settings import ExportSettings, UsageError, load_config_file, merge

PROG = "mha-serving export"
EPILOG = """\
config file (--config, YAML or JSON): the flags' names as keys, for example
  heads: [1, 2, 4, 8, 16]
  d_model: 512
  layers: 4
  labels: [negative, positive]
flags given on the command line override the file.

--model package.module:factory exports your own model built with export.attention.MultiHeadAttention; the factory
protocol is documented in export/user_model.py and in docs/export.md."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block: main() prints it
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG, argument_default=argparse.SUPPRESS, epilog=EPILOG, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "--out", metavar="DIR", help="folder that receives one sub-folder per configuration (default: models)"
    )
    p.add_argument("--heads", metavar="LIST", help="comma-separated head counts (default: 1,2,4,8,16)")
    p.add_argument("--d-model", metavar="N", type=int, help="model width (default: 512)")
    p.add_argument(
        "--head-dim",
        metavar="N",
        type=int,
        help="size of each head (default: d_model // h; needed when h does not divide)",
    )
    p.add_argument("--layers", metavar="N", type=int, help="encoder blocks (default: 4)")
    p.add_argument("--ff-dim", metavar="N", type=int, help="feed-forward width (default: 4 * d_model)")
    p.add_argument("--max-len", metavar="N", type=int, help="longest sequence, tokens (default: 128)")
    p.add_argument("--vocab-size", metavar="N", type=int, help="token ids (default: 260, the byte tokenizer's)")
    p.add_argument(
        "--num-classes", metavar="N", type=int, help="output classes (default: 2, or the number of --labels)"
    )
    p.add_argument("--labels", metavar="LIST", help="comma-separated class names (default: negative,positive)")
    p.add_argument("--seed", metavar="N", type=int, help="torch seed set before each model is built (default: 0)")
    p.add_argument("--force", action="store_true", help="replace model folders that exist (default: skip them)")
    p.add_argument("--attention", action="store_true", help="also export model.attn.onnx with per-head weights")
    p.add_argument(
        "--precision",
        metavar="LIST",
        help="comma-separated fp32,int8,fp16: variants made from each fp32 export after their gate (default: fp32)",
    )
    p.add_argument("--atol", metavar="X", type=float, help="parity gate tolerance, max abs difference (default: 1e-4)")
    p.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="package.module:factory, your own model built with our attention layer",
    )
    p.add_argument(
        "--name-prefix", metavar="PREFIX", help="prefix of the configuration names (default: mha, lm with --decoder)"
    )
    p.add_argument(
        "--decoder",
        action="store_true",
        help="export decoder-only language models with a KV cache (lm-h8-kv2-d512), untrained",
    )
    p.add_argument(
        "--kv-heads", metavar="N", type=int, help="a decoder's key/value heads, dividing each h (default: h)"
    )
    p.add_argument(
        "--config", metavar="FILE", type=Path, help="YAML or JSON file with the same keys; flags override it"
    )
    return p


def parse_settings(argv: list[str]) -> ExportSettings:
    flags = vars(_parser().parse_args(argv))
    config_path = flags.pop("config", None)
    file_values = load_config_file(config_path) if config_path is not None else {}
    return merge(file_values, flags, source=str(config_path or ""))


@dataclass(frozen=True)
class Job:
    """One configuration to export: an EncoderConfig, or None for a factory that fixes its own configuration."""

    config: object  # export.model.EncoderConfig | None (torch is imported only once the arguments are good)


def _decoder_jobs(settings: ExportSettings) -> list[Job]:
    from export.decoder import DecoderConfig
    from export.decoder_parity import MIN_CONTEXT

    given = [flag for flag, on in _CLASSIFIER_ONLY.items() if on(settings)]
    if given:
        raise UsageError(f"{given[0]} does not apply to --decoder (a language model has no classes or variants yet)")
    if settings.max_len < MIN_CONTEXT:
        raise UsageError(
            f"--max-len {settings.max_len} is below {MIN_CONTEXT}: the generation parity gate runs a prompt and "
            f"32 generated tokens within the context length"
        )
    jobs = []
    for h in settings.heads:
        kwargs = dict(heads=h, kv_heads=settings.kv_heads, d_model=settings.d_model, head_dim=settings.head_dim)
        kwargs.update(layers=settings.layers, ff_dim=settings.ff_dim, max_len=settings.max_len)
        kwargs.update(vocab_size=settings.vocab_size, name_prefix=settings.prefix)
        try:
            jobs.append(Job(DecoderConfig(**kwargs)))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    return jobs


_CLASSIFIER_ONLY = {  # flags that --decoder refuses, with how to tell they were given
    "--model": lambda s: s.model is not None,
    "--attention": lambda s: s.attention,
    "--labels": lambda s: s.labels is not None,
    "--num-classes": lambda s: s.num_classes is not None,
    "--precision": lambda s: s.precision != ("fp32",),
}


def _jobs(settings: ExportSettings, takes_config: bool) -> list[Job]:
    from export.model import EncoderConfig

    if settings.decoder:
        return _decoder_jobs(settings)
    if settings.kv_heads is not None:
        raise UsageError("--kv-heads needs --decoder: a classifier's layers have as many key/value heads as heads")
    num_classes, labels = settings.class_labels()
    if not takes_config:
        if settings.heads_given:
            raise UsageError("--heads has no effect: the --model factory takes no arguments and fixes its own heads")
        return [Job(None)]
    jobs = []
    for h in settings.heads:
        kwargs = dict(heads=h, d_model=settings.d_model, head_dim=settings.head_dim, layers=settings.layers)
        kwargs.update(ff_dim=settings.ff_dim, max_len=settings.max_len, vocab_size=settings.vocab_size)
        kwargs.update(num_classes=num_classes, name_prefix=settings.prefix)
        if labels is not None:
            kwargs["labels"] = labels
        try:
            jobs.append(Job(EncoderConfig(**kwargs)))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    return jobs


def _check_writable(out: Path) -> None:
    from export.convert import ExportError

    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=out).cleanup()
    except OSError as exc:
        raise ExportError(f"cannot write to output folder {out}: {exc.strerror or exc}") from exc


def _build(job: Job, settings: ExportSettings, factory, exporter: dict[str, str]):
    """(model, attention variant or None, metadata) for one job, the seed set first."""
    import torch

    from export import user_model
    from export.decoder import DecoderConfig, DecoderLM
    from export.model import AttentionOutputs, EncoderClassifier

    torch.manual_seed(settings.seed)
    if isinstance(job.config, DecoderConfig):
        return DecoderLM(job.config), None, job.config.metadata(exporter)
    if factory is None:
        model = EncoderClassifier(job.config)
        variant = AttentionOutputs(model) if settings.attention else None
        return model, variant, job.config.metadata(exporter)
    model = factory.build(job.config)
    num_classes, labels = settings.class_labels()
    defaults = dict(vocab_size=settings.vocab_size, max_len=settings.max_len, num_classes=num_classes)
    defaults["labels"] = labels or ("negative", "positive")  # class_labels() gives None only for 2 classes
    meta = user_model.describe(model, factory.spec, defaults, settings.prefix, exporter)
    variant = user_model.WithAttention(model, factory.spec) if settings.attention else None
    return model, variant, meta


def _run(settings: ExportSettings, factory, jobs: list[Job]) -> list:
    from export.convert import export_model, exporter_versions
    from export.decoder_export import export_decoder

    exporter = exporter_versions()
    results = []
    for i, job in enumerate(jobs, start=1):
        step = f"[{i}/{len(jobs)}]"
        start = time.perf_counter()
        label = job.config.name if factory is None else factory.spec
        try:
            model, variant, meta = _build(job, settings, factory, exporter)
            label = meta.name
            if (settings.out / meta.name).exists() and not settings.force:
                print(f"{step} {meta.name}: exists in {settings.out}, skipped (--force replaces it)", flush=True)
            else:
                print(f"{step} {meta.name}: exporting ({_describe(meta, model, variant)}) ...", flush=True)
                if settings.decoder:
                    result = export_decoder(model, meta, settings.out, atol=settings.atol)
                else:
                    result = export_model(model, meta, settings.out, attention_variant=variant, atol=settings.atol)
                result = replace(result, seconds=time.perf_counter() - start)  # building the model included
                print(
                    f"{step} {meta.name}: passed the parity gate (max diff {result.max_diff:.2g}), "
                    f"{file_size(result.file_bytes)}, {result.seconds:.1f} s",
                    flush=True,
                )
                results.append(result)
            _variants(step, settings, meta.name)
        except Exception as exc:
            message = _message(exc)
            raise _Failed(message if label in message else f"{label}: {message}") from exc
    return results


def _variants(step: str, settings: ExportSettings, name: str) -> None:
    """The int8 / fp16 variants asked for by --precision, made from the fp32 folder `name`."""
    from export.quantize import make_variant, variant_name

    for precision in settings.precision[1:]:
        target = settings.out / variant_name(name, precision)
        if target.exists() and not settings.force:
            print(f"{step} {target.name}: exists in {settings.out}, skipped (--force replaces it)", flush=True)
            continue
        variant = make_variant(settings.out / name, precision)
        print(
            f"{step} {variant.name}: passed the quality gate ({variant.gate.summary()}), "
            f"{file_size(variant.file_bytes)}, {variant.seconds:.1f} s",
            flush=True,
        )


def _describe(meta, model, variant) -> str:
    params = sum(p.numel() for p in model.parameters())
    layers = f"{meta.layers} layer{'s' if meta.layers != 1 else ''}"
    kv = f", kv_heads={meta.kv_heads}" if hasattr(meta, "kv_heads") else ""
    text = f"h={meta.heads}{kv}, head_dim={meta.head_dim}, d_model={meta.d_model}, {layers}, {params:,} params"
    return text + (", with the attention variant" if variant is not None else "")


class _Failed(RuntimeError):
    """An export failed (exit status 1); the message is already one line."""


def _message(exc: Exception) -> str:
    """Our typed errors already say what failed, in their first line; anything else by its root cause."""
    from contract.metadata import MetadataError
    from export.convert import ExportError, one_line
    from export.parity import ParityError
    from export.quantize import QuantizeError
    from export.user_model import FactoryError

    if isinstance(exc, ExportError | ParityError | FactoryError | MetadataError | QuantizeError):
        return str(exc).splitlines()[0]
    return one_line(exc)


def file_size(n: int) -> str:
    """A file's size as the export and quantize commands print it: MiB, or KiB below one MiB."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _row(r) -> tuple[str, ...]:
    meta = r.metadata
    return (
        r.name,
        str(meta.heads),
        str(meta.head_dim),
        f"{r.params:,}",
        file_size(r.file_bytes),
        f"{r.max_diff:.2g}",
        f"{r.seconds:.1f}",
    )


def format_table(results: list) -> str:
    """name, h, head_dim, params, file size, max diff, seconds: one row per exported configuration."""
    header = ("name", "h", "head_dim", "params", "file size", "max diff", "seconds")
    rows = [_row(r) for r in results]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = parse_settings(argv)
        from export import user_model  # imports torch: after the arguments parsed, so --help stays quick

        factory = user_model.resolve(settings.model) if settings.model else None
        jobs = _jobs(settings, takes_config=factory is None or factory.takes_config)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ModuleNotFoundError as exc:  # torch, when the export extra is not installed
        print(
            f"{PROG}: {exc.name!r} is not installed; install the export extra: pip install -e '.[export]'",
            file=sys.stderr,
        )
        return 2
    created = not settings.out.exists()
    try:
        _check_writable(settings.out)
        results = _run(settings, factory, jobs)
    except (_Failed, RuntimeError, KeyboardInterrupt) as exc:  # _Failed, or ExportError from _check_writable
        if created and settings.out.is_dir() and not any(settings.out.iterdir()):
            settings.out.rmdir()  # we made it and nothing was exported: leave no trace
        if isinstance(exc, KeyboardInterrupt):
            print(f"{PROG}: interrupted; no half-written model folder was left behind", file=sys.stderr)
            return 130
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    if results:
        print()
        print(format_table(results))
    print(f"{len(results)} exported to {settings.out}/", flush=True)
    return 0
