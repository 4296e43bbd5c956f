"""`mha-serving sweep`: train every head count on one task with every other setting fixed, several seeds each, export
each h once, time them all (ONNX Runtime in-process, or a running service with --url; --retime times an earlier
sweep's models again without training) and report quality versus latency. In-process, each exported model also gets
an int8 twin (dynamic quantization), measured on the same validation split and timed in the same rounds. With
--task docs-lm it sweeps decoders over h and kv_heads instead (export/lm_sweep.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from contract.metadata import CONFIG_FILE
from export.convert import ExportError
from export.docs_corpus import CORPUS
from export.lm_sweep import check_lm_options, lm_sweep
from export.parity import ParityError
from export.quantize import GateSettings, QuantizeError, cpu_flags, gate_data, plan_int8, source_metadata
from export.sweep_report import Run, summarize, write_report
from export.sweep_timing import (
    INT8_MODE,
    ROUNDS,
    Int8Twin,
    TimingError,
    in_process_caller,
    int8_twin,
    service_caller,
    time_models,
)
from export.tasks import Task, get_task
from export.train import TrainResult, export_trained, train
from export.train_cli import add_training_arguments, training_config

LATENCY_SEED = 12345  # the texts that are timed (never trained on: the training data uses the run's seed)


class SweepError(ValueError):
    """A sweep option that cannot work: a malformed head list, a head count that does not fit d_model, no service."""


def parse_heads(text: str, flag: str = "--heads") -> list[int]:
    try:
        heads = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SweepError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not heads or any(h < 1 for h in heads) or len(set(heads)) != len(heads):
        raise SweepError(f"{flag} needs distinct integers >= 1, got {text!r}")
    return sorted(heads)


def int8_twins(
    args: argparse.Namespace, folders: dict[int, Path], scratch: Path
) -> tuple[dict[int, Int8Twin], dict[str, object] | str]:
    """h -> the int8 twin of its exported model, measured on that model's validation split; and how they were made
    (for the settings). No twins with --no-int8, nor with --url: a service times only the models it serves."""
    if args.no_int8 or args.url:
        return {}, "not measured: " + ("--no-int8" if args.no_int8 else "timed through a service (--url)")
    plan = plan_int8(cpu_flags())
    twins = {}
    for h, folder in folders.items():
        twins[h] = int8_twin(folder, scratch, gate_data(folder, source_metadata(folder), GateSettings()), plan)
        accuracy = "n/a" if twins[h].accuracy is None else f"{twins[h].accuracy:.4f}"
        print(f"  int8 h={h}: val acc {accuracy}, argmax agreement {twins[h].agreement:.2%}", flush=True)
    data = sorted({t.data for t in twins.values()})
    method = {"mode": INT8_MODE, "weights": plan.weights, "reduce_range": plan.reduce_range, "why": plan.reason}
    return twins, {**method, "data": ", ".join(data)}


def time_exported(
    args: argparse.Namespace, task: Task, folders: dict[int, Path], int8: dict[int, Path]
) -> tuple[dict[int, tuple[float, ...]], dict[int, tuple[float, ...]]]:
    """p50 latency per h of the exported models, in-process or (with --url) through the running service; and of their
    int8 twins (in-process), in the same interleaved rounds, so each int8/fp32 ratio shares the machine's noise."""
    texts = [e.text for e in task.generate(64, LATENCY_SEED)]
    where = f"the service at {args.url}" if args.url else f"onnxruntime in-process ({args.threads} thread(s))"
    count = f"{len(folders)} model(s)" + (f" and {len(int8)} int8 twin(s)" if int8 else "")
    print(f"timing {count} with {where}, interleaved over {ROUNDS} rounds", flush=True)
    if not args.url:
        callers = {}
        for h, folder in folders.items():
            callers[h, "fp32"] = in_process_caller(folder, texts, task.max_len, args.threads)
            if h in int8:
                callers[h, "int8"] = in_process_caller(int8[h], texts, task.max_len, args.threads)
        latency = time_models(callers, args.repeats)
        fp32 = {h: p50 for (h, precision), p50 in latency.items() if precision == "fp32"}
        return fp32, {h: p50 for (h, precision), p50 in latency.items() if precision == "int8"}
    import httpx

    with httpx.Client(timeout=30.0) as client:
        callers = {h: service_caller(client, args.url, f.name, texts) for h, f in folders.items()}
        return time_models(callers, args.repeats), {}


def exported_folders(models_dir: Path) -> dict[int, Path]:
    """h -> fp32 model folder of an earlier sweep (from each folder's config.json)."""
    folders = {}
    for config in sorted(models_dir.glob(f"*/{CONFIG_FILE}")):
        record = json.loads(config.read_text())
        if record.get("precision", "fp32") != "fp32":  # a variant beside its source (mha-serving quantize): same h
            continue
        folders[int(record["heads"])] = config.parent
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
        "--no-int8",
        action="store_true",
        help="no int8 twins (by default each exported model is also quantized, measured and timed as int8)",
    )
    parser.add_argument(
        "--retime",
        action="store_true",
        help="no training: time the models of the earlier sweep in --out again (e.g. with --url once they are served)",
    )
    parser.add_argument(
        "--kv-heads", default=None, help=f"{CORPUS}: key/value heads to compare at the largest --heads (e.g. 1,2,4,8)"
    )
    parser.add_argument("--max-len", type=int, default=None, help=f"{CORPUS}: context length (default 128)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.repeats < 1:
        raise SweepError(f"--seeds and --repeats must be >= 1, got {args.seeds} and {args.repeats}")
    args.heads = parse_heads(args.heads)
    if args.kv_heads is not None:
        args.kv_heads = parse_heads(args.kv_heads, "--kv-heads")
    check_lm_options(args)
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
        if args.task == CORPUS:
            return lm_sweep(args)
        if args.retime:
            runs, settings = _earlier_sweep(args.out)
            task = get_task(str(settings["task"]))
            folders = exported_folders(args.out / "models")
        else:
            task = get_task(args.task)
            args.out.mkdir(parents=True, exist_ok=True)
            settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            runs, folders = _train_all(args, task)
        with tempfile.TemporaryDirectory(prefix=".sweep-int8.") as scratch:  # the twins live until they are timed
            twins, int8_method = int8_twins(args, folders, Path(scratch))
            latency, int8_latency = time_exported(args, task, folders, {h: t.folder for h, t in twins.items()})
    except (ValueError, ExportError, ParityError, FloatingPointError, TimingError, QuantizeError, OSError) as exc:
        print(f"mha-serving sweep: {exc}", file=sys.stderr)
        return 2
    settings = {
        **settings,
        **{k: getattr(args, k) for k in ("url", "repeats", "threads", "retime", "no_int8")},
        "int8": int8_method,
        "timed_by": f"service at {args.url}" if args.url else f"onnxruntime in-process, {args.threads} thread(s)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    title = (
        f"{task.name}: d_model {settings['d_model']}, {settings['layers']} layer(s), {settings['steps']} steps, "
        f"{settings['seeds']} seed(s) per h"
    )
    rows = summarize(runs, latency, twins, int8_latency)
    paths = write_report(args.out, rows, runs, settings, title)
    print((args.out / "sweep.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
