"""`mha-serving sweep`: train every head count on one task with every other setting fixed, several seeds each, export
each h once, time it (ONNX Runtime in-process, or a running service with --url) and report quality versus latency.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from export.convert import ExportError
from export.metadata import ATTENTION_MASK, INPUT_IDS, MODEL_FILE
from export.parity import ParityError
from export.sweep_report import Run, summarize, write_report
from export.tasks import Task, get_task
from export.tokenizer import ByteTokenizer
from export.train import TrainResult, export_trained, train
from export.train_cli import add_training_arguments, training_config

LATENCY_SEED = 12345  # the texts that are timed (never trained on: the training data uses the run's seed)
BATCHES = (1, 32)


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


def time_in_process(model_dir: Path, texts: list[str], max_len: int, threads: int, repeats: int) -> tuple[float, ...]:
    """p50 milliseconds per call of model.onnx with ONNX Runtime on CPU, at each batch size in BATCHES."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model_dir / MODEL_FILE), options, providers=["CPUExecutionProvider"])
    tokenizer = ByteTokenizer(max_len)
    p50s = []
    for batch in BATCHES:
        ids, mask = tokenizer.encode_batch(texts[:batch])
        feed = {INPUT_IDS: np.array(ids, dtype=np.int64), ATTENTION_MASK: np.array(mask, dtype=np.int64)}
        for _ in range(10):  # warm-up
            session.run(None, feed)
        times = []
        for _ in range(repeats if batch == 1 else max(10, repeats // 4)):
            start = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - start)
        p50s.append(statistics.median(times) * 1e3)
    return tuple(p50s)


def time_service(url: str, name: str, texts: list[str], repeats: int) -> tuple[float, ...]:
    """p50 milliseconds per request to a running service's /v1/models/{name}/predict, at each batch size."""
    import httpx

    endpoint = f"{url.rstrip('/')}/v1/models/{name}/predict"
    p50s = []
    with httpx.Client(timeout=30.0) as client:
        for batch in BATCHES:
            body = {"text": texts[0]} if batch == 1 else {"texts": texts[:batch]}
            times = []
            for i in range(10 + (repeats if batch == 1 else max(10, repeats // 4))):
                start = time.perf_counter()
                try:
                    response = client.post(endpoint, json=body)
                except httpx.HTTPError as exc:
                    raise SweepError(f"cannot reach {endpoint}: {exc}") from exc
                if response.status_code != 200:
                    raise SweepError(f"{endpoint} answered {response.status_code}: {response.text[:200]}")
                if i >= 10:  # the first 10 are warm-up
                    times.append(time.perf_counter() - start)
            p50s.append(statistics.median(times) * 1e3)
    return tuple(p50s)


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
    parser.add_argument("--url", default=None, help="time a running service here instead of in-process ORT")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls at batch 1 (batch 32: a quarter)")
    parser.add_argument("--attention", action="store_true", help="also export model.attn.onnx for each h")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.repeats < 1:
        raise SweepError(f"--seeds and --repeats must be >= 1, got {args.seeds} and {args.repeats}")
    args.heads = parse_heads(args.heads)
    if args.out is None:
        args.out = Path("runs") / f"{args.task}-d{args.d_model}"
    return args


def _sweep(args: argparse.Namespace, task: Task) -> tuple[list[Run], dict[int, tuple[float, ...]]]:
    configs = {h: [training_config(args, h, seed) for seed in range(args.seeds)] for h in args.heads}
    for per_seed in configs.values():  # every h checked before any training starts
        per_seed[0].model_config(task)
    texts = [e.text for e in task.generate(64, LATENCY_SEED)]
    runs, latency = [], {}
    total, done = len(args.heads) * args.seeds, 0
    for h, per_seed in configs.items():
        for config in per_seed:
            done += 1
            print(f"[{done}/{total}] h={h} seed={config.seed}", flush=True)
            result = train(config, log=lambda line, h=h: print(f"  h={h:<3} {line}", flush=True))
            runs.append(_run_record(result))
            if config.seed == 0:
                exported = export_trained(result, args.out / "models", attention=args.attention)
                if args.url:
                    latency[h] = time_service(args.url, exported.name, texts, args.repeats)
                else:
                    latency[h] = time_in_process(exported.folder, texts, task.max_len, args.threads, args.repeats)
                print(f"  h={h:<3} p50 latency: batch 1 {latency[h][0]:.3f} ms, batch 32 {latency[h][1]:.3f} ms")
    return runs, latency


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
        task = get_task(args.task)
        torch.set_num_threads(max(1, args.threads))
        args.out.mkdir(parents=True, exist_ok=True)
        runs, latency = _sweep(args, task)
    except (ValueError, ExportError, ParityError, FloatingPointError, OSError) as exc:
        print(f"mha-serving sweep: {exc}", file=sys.stderr)
        return 2
    settings = {
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "timed_by": f"service at {args.url}" if args.url else f"onnxruntime in-process, {args.threads} thread(s)",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), {platform.python_version()}",
    }
    title = (
        f"{task.name}: d_model {args.d_model}, {args.layers} layer(s), {args.steps} steps, {args.seeds} seed(s) per h"
    )
    rows = summarize(runs, latency)
    paths = write_report(args.out, rows, runs, settings, title)
    print((args.out / "sweep.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
