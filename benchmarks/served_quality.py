"""A served decoder's quality measured through the server: lm-evaluation-harness's `local-completions` running the
repository's docs-lm tasks (evaluation/lm_eval) against `/openai/v1/completions`, with the model folder's tokenizer,
batched and concurrent. One place builds the command (the docs' and the tests') and reads its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS_DIR = "evaluation/lm_eval"  # --include_path, from the repository's root (the tasks' data paths are relative)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing downloaded
METRICS = {  # task -> the metrics read from lm-eval's results
    "docs_lm_perplexity": ("bits_per_byte", "byte_perplexity", "word_perplexity"),
    "docs_lm_choice": ("acc", "acc_norm"),
    "docs_lm_continue": ("exact_match",),
}


class EvaluationError(RuntimeError):
    """lm_eval exited non-zero or wrote no results."""


def lm_eval_command(
    url: str,
    model: str,
    folder: Path,
    context: int,
    tasks: str = "docs_lm",
    batch_size: int = 4,
    concurrent: int = 2,
    limit: int | None = None,
    out: Path | None = None,
) -> list[str]:
    """lm_eval against the service at `url` (http://host:port) for `model`, its tokenizer read from `folder`.
    `max_length` is the context less one: lm-eval's likelihood requests ask one token past the echoed prompt."""
    model_args = (
        f"model={model},base_url={url}/openai/v1/completions,tokenizer={folder},tokenizer_backend=huggingface,"
        f"max_length={context - 1},num_concurrent={concurrent},max_retries=1"
    )
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    command += ["--include_path", TASKS_DIR, "--tasks", tasks, "--batch_size", str(batch_size)]
    command += ["--limit", str(limit)] if limit is not None else []
    return command + (["--output_path", str(out)] if out is not None else [])


def evaluate(
    url: str, model: str, folder: Path, context: int, tasks: str = "docs_lm", limit: int | None = None, **more
) -> dict:
    """Run lm_eval (lm_eval_command's) and return its results file's contents."""
    with tempfile.TemporaryDirectory(prefix="mha-lm-eval-") as scratch:
        out = Path(scratch) / "out"
        command = lm_eval_command(url, model, folder, context, tasks, limit=limit, out=out, **more)
        env = {**os.environ, **OFFLINE, "HF_HOME": str(Path(scratch) / "hf")}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        found = sorted(out.rglob("results_*.json"))
        if done.returncode != 0 or not found:
            raise EvaluationError(f"lm_eval exited {done.returncode}: {done.stderr[-2000:]}")
        return json.loads(found[-1].read_text())


def scores(results: dict) -> dict[str, float]:
    """`task.metric` -> value for the tasks and METRICS present in lm-eval's results."""
    got = {}
    for task, metrics in METRICS.items():
        for metric in metrics:
            value = results.get("results", {}).get(task, {}).get(f"{metric},none")
            if value is not None:
                got[f"{task}.{metric}"] = float(value)
    return got
