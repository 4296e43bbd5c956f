"""`mha-serving sweep`: train every head count on one task with every other setting fixed, several seeds each, export
each h once, time them all (ONNX Runtime in-process, or a running service with --url; --retime times an earlier
sweep's models again without training) and report quality versus latency.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from contract.metadata import CONFIG_FILE
from export.convert import ExportError
from export.parity import ParityError
from export.sweep_report import Run, summarize, write_report
from export.sweep_timing import ROUNDS, TimingError, in_process_caller, service_caller, time_models
from export.tasks import Task, get_task
from export.train import TrainResult, export_trained, train
from export.train_cli import add_training_arguments, training_config

LATENCY_SEED = 12345  # the texts that are timed (never trained on: the training data uses the run's seed)


class SweepError(ValueError):
    """A sweep option that cannot work: a malformed head list, a head count that does not fit d_model, no service."""


def parse_heads(text: str) -> list[int]:
    try:
        heads = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SweepError(f"--heads must be a comma-separated list of integers, got {text!r}") from None
    if not heads or any(h < 1 for h in heads) or len(set(heads)) != len(heads):
        raise SweepError(f"--heads needs distinct integers >= 1, got {text!r}")
    return sorted(heads)


def time_exported(args: argparse.Namespace, task: Task, folders: dict[int, Path]) -> dict[int, tuple[float, ...]]:
    """p50 latency per h of the exported models, in-process or (with --url) through the running service."""
    texts = [e.text for e in task.generate(64, LATENCY_SEED)]
    where = f"the service at {args.url}" if args.url else f"onnxruntime in-process ({args.threads} thread(s))"
    print(f"timing {len(folders)} model(s) with {where}, interleaved over {ROUNDS} rounds", flush=True)
    if not args.url:
        callers = {h: in_process_caller(f, texts, task.max_len, args.threads) for h, f in folders.items()}
        return time_models(callers, args.repeats)
    import httpx

    with httpx.Client(timeout=30.0) as client:
        callers = {h: service_caller(client, args.url, f.name, texts) for h, f in folders.items()}
        return time_models(callers, args.repeats)


def exported_folders(models_dir: Path) -> dict[int, Path]:
    """h -> model folder of an earlier sweep (from each folder's config.json)."""
    folders = {}
    for config in sorted(models_dir.glob(f"*/{CONFIG_FILE}")):
        folders[int(json.loads(config.read_text())["heads"])] = config.parent
    if not folders:
        raise SweepError(f"no exported models under {models_dir}: run the sweep without --retime first")
    return folders


def _run_record(result: TrainResult) -> Run:
    c = result.config
    return Run(
        heads=c.heads,
        head_dim=c.head_dim or c.d_model // c.heads,
        seed=c.seed,
        params=result.params,
        val_loss=result.val_loss,
        val_acc=result.val_acc,
        train_s=result.seconds,
        spikes=len(result.spikes),
        max_grad_norm=result.max_grad_norm,
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mha-serving sweep", description=__doc__)
    add_training_arguments(parser)
    parser.add_argument("--heads", default="1,2,4,8,16", help="head counts to compare (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per head count (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default runs/<task>-d<d_model>)")
    parser.add_argument("--url", default=None, help="time a running service serving the sweep's models (its base URL)")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls at batch 1 (batch 32: a quarter)")
    parser.add_argument("--attention", action="store_true", help="also export model.attn.onnx for each h")
    parser.add_argument(
        "--retime",
        action="store_true",
        help="no training: time the models of the earlier sweep in --out again (e.g. with --url once they are served)",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.repeats < 1:
        raise SweepError(f"--seeds and --repeats must be >= 1, got {args.seeds} and {args.repeats}")
    args.heads = parse_heads(args.heads)
    if args.out is None:
        args.out = Path("runs") / f"{args.task}-d{args.d_model}"
    return args


def _train_all(args: argparse.Namespace, task: Task) -> tuple[list[Run], dict[int, Path]]:
    """Every h, every seed; each h's seed-0 model exported (with its task's labels) for timing and serving."""
    configs = {h: [training_config(args, h, seed) for seed in range(args.seeds)] for h in args.heads}
    for per_seed in configs.values():  # every h checked before any training starts
        per_seed[0].model_config(task)
    runs, folders = [], {}
    total, done = len(args.heads) * args.seeds, 0
    for h, per_seed in configs.items():
        for config in per_seed:
            done += 1
            print(f"[{done}/{total}] h={h} seed={config.seed}", flush=True)
            result = train(config, log=lambda line, h=h: print(f"  h={h:<3} {line}", flush=True))
            runs.append(_run_record(result))
            if config.seed == 0:
                folders[h] = export_trained(result, args.out / "models", attention=args.attention).folder
    return runs, folders


def _earlier_sweep(out: Path) -> tuple[list[Run], dict[str, object]]:
    path = out / "sweep.json"
    if not path.is_file():
        raise SweepError(f"--retime: {path} does not exist; run the sweep without --retime first")
    record = json.loads(path.read_text())
    return [Run(**r) for r in record["runs"]], record["settings"]


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
        torch.set_num_threads(max(1, args.threads))
        if args.retime:
            runs, settings = _earlier_sweep(args.out)
            task = get_task(str(settings["task"]))
            folders = exported_folders(args.out / "models")
        else:
            task = get_task(args.task)
            args.out.mkdir(parents=True, exist_ok=True)
            settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            runs, folders = _train_all(args, task)
        latency = time_exported(args, task, folders)
    except (ValueError, ExportError, ParityError, FloatingPointError, TimingError, OSError) as exc:
        print(f"mha-serving sweep: {exc}", file=sys.stderr)
        return 2
    settings = {
        **settings,
        **{k: getattr(args, k) for k in ("url", "repeats", "threads", "retime")},
        "timed_by": f"service at {args.url}" if args.url else f"onnxruntime in-process, {args.threads} thread(s)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    title = (
        f"{task.name}: d_model {settings['d_model']}, {settings['layers']} layer(s), {settings['steps']} steps, "
        f"{settings['seeds']} seed(s) per h"
    )
    rows = summarize(runs, latency)
    paths = write_report(args.out, rows, runs, settings, title)
    print((args.out / "sweep.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
