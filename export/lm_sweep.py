"""`mha-serving sweep --task docs-lm`: decoders over h at a fixed d_model (MHA, so head_dim shrinks) and over kv_heads
at the largest h, several seeds each; validation loss (mean and spread over seeds), perplexity and the KV cache's
bytes per token; each configuration's seed-0 model exported through the generation parity gate. No timing yet.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

from export.convert import ExportError
from export.docs_corpus import CORPUS, load_corpus
from export.lm_sweep_report import LMRun, summarize, write_report
from export.lm_train import LMTrainConfig, LMTrainResult, export_trained_lm, train_lm
from export.lm_train_cli import lm_config
from export.parity import ParityError

PROG = "mha-serving sweep"
CLASSIFIER_ONLY = ("--retime", "--url", "--attention")  # the decoders' sweep measures quality and cache size only
UNUSED = ("examples", "url", "repeats", "attention", "no_int8", "retime")  # the classifiers' options, not recorded
RUNS_FILE = "runs.jsonl"
RESUMABLE = ("heads", "kv_heads", "seeds", "log_every", "threads", "out")  # what a run found in RUNS_FILE may differ in


def check_lm_options(args: argparse.Namespace) -> None:
    """ValueError (one line) for an option that does not apply to the task; with docs-lm, for a kv_heads that does
    not divide the largest h."""
    if args.task != CORPUS:
        given = [flag for flag, value in (("--kv-heads", args.kv_heads), ("--max-len", args.max_len)) if value]
        if given:
            raise ValueError(f"{given[0]} applies to --task {CORPUS} only")
        return
    given = [flag for flag in CLASSIFIER_ONLY if getattr(args, flag[2:])]
    if given:
        raise ValueError(f"{given[0]} does not apply to --task {CORPUS}: its sweep reports loss and KV bytes, untimed")
    configurations(args.heads, args.kv_heads or [])


def configurations(heads: list[int], kv_heads: list[int]) -> list[tuple[int, int]]:
    """(h, kv_heads) pairs: every h with kv_heads = h (MHA), then every kv_heads at the largest h."""
    top = max(heads)
    bad = [kv for kv in kv_heads if top % kv != 0]
    if bad:
        divisors = [k for k in range(1, top + 1) if top % k == 0]
        raise ValueError(
            f"--kv-heads {bad[0]} does not divide h={top} (the largest --heads, where kv_heads is swept); "
            f"choose from {divisors}"
        )
    pairs = [(h, h) for h in heads]
    return pairs + [(top, kv) for kv in kv_heads if kv != top]


def training_configs(args: argparse.Namespace) -> dict[tuple[int, int], list[LMTrainConfig]]:
    """(h, kv) -> one LMTrainConfig per seed; every one checked before any training starts."""
    configs = {}
    for h, kv in configurations(args.heads, args.kv_heads or []):
        values = {**vars(args), "heads": h, "kv_heads": kv, "val_fraction": None}
        configs[h, kv] = [lm_config(argparse.Namespace(**values, seed=seed)) for seed in range(args.seeds)]
    first = configs[next(iter(configs))][0]
    load_corpus(first.val_fraction).check(first.max_len)  # a context the validation split cannot fill
    return configs


def run_record(result: LMTrainResult) -> LMRun:
    c = result.model.config
    return LMRun(
        heads=c.heads,
        kv_heads=c.resolved_kv_heads,
        head_dim=c.resolved_head_dim,
        layers=c.layers,
        seed=result.config.seed,
        params=result.params,
        val_loss=result.val_loss,
        val_perplexity=result.val_perplexity,
        kv_bytes_per_token=c.metadata().kv_bytes_per_token,
        train_s=result.seconds,
        max_grad_norm=max(norm for _, _, norm in result.history),
    )


def train_all(
    args: argparse.Namespace, configs: dict[tuple[int, int], list[LMTrainConfig]], settings: dict[str, object]
) -> list[LMRun]:
    """Every configuration, every seed; each configuration's seed-0 model exported to <out>/models. Each run is
    appended to <out>/runs.jsonl as it ends, and a sweep started again with the same settings skips the runs found
    there (a sweep of hours on a small machine survives an interruption)."""
    corpus = load_corpus(configs[next(iter(configs))][0].val_fraction)
    done_runs = finished_runs(args.out / RUNS_FILE, settings)
    runs = []
    total, done = sum(len(per_seed) for per_seed in configs.values()), 0
    for (h, kv), per_seed in configs.items():
        for config in per_seed:
            done += 1
            if (h, kv, config.seed) in done_runs:
                print(f"[{done}/{total}] h={h} kv_heads={kv} seed={config.seed}: found in {RUNS_FILE}", flush=True)
                runs.append(done_runs[h, kv, config.seed])
                continue
            print(f"[{done}/{total}] h={h} kv_heads={kv} seed={config.seed}", flush=True)
            log = lambda line, h=h, kv=kv: print(f"  h={h} kv={kv} {line}", flush=True)  # noqa: E731
            result = train_lm(config, log=log, corpus=corpus)
            if config.seed == 0:
                exported = export_trained_lm(result, args.out / "models")
                print(f"  exported {exported.name} (parity max diff {exported.max_diff:.2g})", flush=True)
            runs.append(run_record(result))
            with (args.out / RUNS_FILE).open("a") as f:
                f.write(json.dumps({"settings": settings, "run": asdict(runs[-1])}) + "\n")
    return runs


def finished_runs(path: Path, settings: dict[str, object]) -> dict[tuple[int, int, int], LMRun]:
    """(h, kv_heads, seed) -> the run recorded in `path` under the same settings (others are ignored)."""
    if not path.is_file():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["settings"] == settings:
            run = LMRun(**record["run"])
            found[run.heads, run.kv_heads, run.seed] = run
    return found


def lm_sweep(args: argparse.Namespace) -> int:
    """Run the decoders' sweep with the options `mha-serving sweep` parsed; the exit status."""
    try:
        configs = training_configs(args)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in UNUSED}
        settings["max_len"] = configs[next(iter(configs))][0].max_len
        args.out.mkdir(parents=True, exist_ok=True)
        runs = train_all(args, configs, {k: v for k, v in settings.items() if k not in RESUMABLE})
    except (ValueError, ExportError, ParityError, FloatingPointError, OSError) as exc:
        print(f"{PROG}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    settings["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    title = (
        f"{CORPUS}: d_model {args.d_model}, {args.layers} layer(s), context {settings['max_len']}, {args.steps} steps "
        f"of batch {args.batch_size}, {args.seeds} seed(s) per configuration"
    )
    rows = summarize(runs)
    paths = write_report(args.out, rows, runs, settings, title)
    print((args.out / "sweep.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
