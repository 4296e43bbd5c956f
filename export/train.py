"""Training on a built-in task: AdamW, linear warm-up then cosine decay, gradient clipping, a fixed seed, a validation
split, progress lines, and a record of gradient norms and loss spikes. Trained models export through export_model.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from contract.metadata import TRAINING_FILE
from contract.tokenizer import ByteTokenizer
from export.checkpoint import CHECKPOINT_FILE, checkpoint_bytes
from export.convert import ExportResult, export_model, exporter_versions
from export.model import AttentionOutputs, EncoderClassifier, EncoderConfig
from export.tasks import DEFAULT_TASK, Task, get_task

EMA_BETA = 0.95  # smoothing of the loss that spikes are measured against


@dataclass(frozen=True)
class TrainConfig:
    task: str = DEFAULT_TASK
    heads: int = 4
    d_model: int = 128
    layers: int = 1  # 1: the kv-compare task needs two lookups in one layer (2 layers plateau longer on a CPU budget)
    head_dim: int | None = None  # None: d_model // heads
    ff_dim: int | None = None  # None: 4 * d_model
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.05  # of steps, linear from 0 to lr; cosine decay to 0 after
    grad_clip: float = 1.0  # max total gradient norm (norms are recorded before clipping)
    seed: int = 0  # model init, data and batch order
    examples: int = 20_000  # generated once; the last val_fraction of them is the validation split
    val_fraction: float = 0.1
    log_every: int = 100
    spike_factor: float = 2.0  # a loss spike: a step's loss above spike_factor x the running average...
    spike_min_delta: float = 0.25  # ...and above it by at least this much (so tiny losses do not count)

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "examples", "log_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {key}={value!r}")
        if not 0.0 < self.val_fraction < 1.0 or int(self.examples * self.val_fraction) < 1:
            raise ValueError(f"val_fraction={self.val_fraction} leaves no validation (or no training) examples")
        if self.lr <= 0 or self.grad_clip <= 0 or not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"need lr > 0, grad_clip > 0, 0 <= warmup_fraction < 1; got {self}")

    def model_config(self, task: Task) -> EncoderConfig:
        """The EncoderConfig this run trains: sized by the config, shaped (max_len, labels) by the task."""
        return EncoderConfig(
            d_model=self.d_model,
            heads=self.heads,
            head_dim=self.head_dim,
            layers=self.layers,
            ff_dim=self.ff_dim,
            max_len=task.max_len,
            num_classes=task.num_classes,
            labels=task.labels,
            task=task.name,
        )


@dataclass(frozen=True)
class LogLine:
    step: int
    loss: float  # mean training loss over the steps since the previous line
    acc: float
    grad_norm: float  # max total gradient norm (before clipping) over those steps
    lr: float


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    running: float  # the running average it jumped above


@dataclass(frozen=True)
class TrainResult:
    config: TrainConfig
    params: int
    val_loss: float
    val_acc: float
    seconds: float
    max_grad_norm: float
    mean_grad_norm: float
    spikes: tuple[Spike, ...]
    history: tuple[LogLine, ...]
    losses: tuple[float, ...]  # every step's training loss
    model: EncoderClassifier = field(repr=False, compare=False)

    def to_json(self) -> dict[str, object]:
        out = asdict(replace(self, model=None, losses=()))  # replace first: asdict would deep-copy the model
        del out["model"], out["losses"]
        out["spike_count"] = len(self.spikes)
        return out


@dataclass(frozen=True)
class Split:
    ids: torch.Tensor  # (N, T) int64, padded with 0
    mask: torch.Tensor  # (N, T) int64, 1 = token
    labels: torch.Tensor  # (N,) int64


def encode_examples(task: Task, n: int, seed: int) -> Split:
    examples = task.generate(n, seed)
    ids, mask = ByteTokenizer(task.max_len).encode_batch([e.text for e in examples])
    labels = [e.label for e in examples]
    return Split(torch.tensor(ids), torch.tensor(mask), torch.tensor(labels))


def split_data(data: Split, val_fraction: float) -> tuple[Split, Split]:
    n_val = int(len(data.labels) * val_fraction)
    cut = len(data.labels) - n_val
    train = Split(data.ids[:cut], data.mask[:cut], data.labels[:cut])
    val = Split(data.ids[cut:], data.mask[cut:], data.labels[cut:])
    return train, val


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up over the first warmup_fraction of steps, then cosine decay to 0 (step counts from 0)."""
    warmup = int(config.steps * config.warmup_fraction)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def batches(n: int, batch_size: int, generator: torch.Generator):
    """Endless random batches of row indices, a fresh permutation each epoch."""
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def trimmed(split: Split, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows, cut to the batch's longest sequence (attention cost grows with T^2)."""
    mask = split.mask[rows]  # (B, T)
    width = int(mask.sum(dim=1).max())
    return split.ids[rows, :width], mask[:, :width], split.labels[rows]


@torch.no_grad()
def evaluate(model: EncoderClassifier, split: Split, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over a split."""
    model.eval()
    total_loss, correct, n = 0.0, 0, len(split.labels)
    for start in range(0, n, batch_size):
        ids, mask, labels = trimmed(split, torch.arange(start, min(n, start + batch_size)))
        logits = model(ids, mask)  # (B, C)
        total_loss += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(dim=1) == labels).sum())
    return total_loss / n, correct / n


def train(config: TrainConfig, log: Callable[[str], None] | None = print) -> TrainResult:
    """Train one configuration from scratch; `log` gets a progress line every log_every steps (None: silent)."""
    task = get_task(config.task)
    model_config = config.model_config(task)
    torch.manual_seed(config.seed)
    model = EncoderClassifier(model_config)
    train_split, val_split = split_data(encode_examples(task, config.examples, config.seed), config.val_fraction)
    if len(train_split.labels) < config.batch_size:
        raise ValueError(f"{len(train_split.labels)} training examples, fewer than batch_size={config.batch_size}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    order = batches(len(train_split.labels), config.batch_size, torch.Generator().manual_seed(config.seed))
    tracker = _Tracker(config, log)
    start = time.perf_counter()
    model.train()
    for step in range(config.steps):
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask, labels = trimmed(train_split, next(order))
        logits = model(ids, mask)  # (B, C)
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip))
        optimizer.step()
        acc = float((logits.argmax(dim=1) == labels).float().mean())
        tracker.record(step, loss.item(), acc, grad_norm, lr)
    seconds = time.perf_counter() - start
    val_loss, val_acc = evaluate(model, val_split)
    if log is not None:
        log(f"validation: loss {val_loss:.4f}  acc {val_acc:.4f}  ({len(val_split.labels)} examples, {seconds:.1f} s)")
    return TrainResult(
        config=config,
        params=model.num_parameters(),
        val_loss=val_loss,
        val_acc=val_acc,
        seconds=seconds,
        max_grad_norm=max(tracker.grad_norms),
        mean_grad_norm=sum(tracker.grad_norms) / len(tracker.grad_norms),
        spikes=tuple(tracker.spikes),
        history=tuple(tracker.history),
        losses=tuple(tracker.losses),
        model=model.eval(),
    )


class _Tracker:
    """Per-step bookkeeping: losses, gradient norms, spikes against a running average, and the progress lines."""

    def __init__(self, config: TrainConfig, log: Callable[[str], None] | None) -> None:
        self.config, self.log = config, log
        self.warmup = int(config.steps * config.warmup_fraction)
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.spikes: list[Spike] = []
        self.history: list[LogLine] = []
        self.running: float | None = None
        self._accs: list[float] = []

    def record(self, step: int, loss: float, acc: float, grad_norm: float, lr: float) -> None:
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss} at step {step + 1} (lr={lr:.2e})")
        c = self.config
        after_warmup = self.running is not None and step >= self.warmup
        if after_warmup and loss > max(c.spike_factor * self.running, self.running + c.spike_min_delta):
            self.spikes.append(Spike(step + 1, loss, self.running))
        self.running = loss if self.running is None else EMA_BETA * self.running + (1 - EMA_BETA) * loss
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self._accs.append(acc)
        if (step + 1) % c.log_every == 0 or step + 1 == c.steps:
            n = len(self._accs)
            line = LogLine(step + 1, sum(self.losses[-n:]) / n, sum(self._accs) / n, max(self.grad_norms[-n:]), lr)
            self.history.append(line)
            self._accs = []
            if self.log is not None:
                self.log(
                    f"step {line.step:>6}/{c.steps}  loss {line.loss:.4f}  acc {line.acc:.3f}  "
                    f"grad-norm {line.grad_norm:.3f}  lr {line.lr:.2e}  spikes {len(self.spikes)}"
                )


def export_trained(result: TrainResult, out_dir: Path, attention: bool = True) -> ExportResult:
    """Export a trained model through the normal path (parity gate, metadata with the task's labels) plus its
    training record (training.json) and torch checkpoint (checkpoint.pt, for `mha-serving heads` and `prune`);
    with `attention`, also model.attn.onnx for attention maps."""
    task = get_task(result.config.task)
    meta = result.config.model_config(task).metadata(exporter_versions())
    variant = AttentionOutputs(result.model) if attention else None
    record = {"task": task.name, "labels": list(task.labels), **result.to_json()}
    extras = {
        TRAINING_FILE: (json.dumps(record, indent=2) + "\n").encode(),
        CHECKPOINT_FILE: checkpoint_bytes(result.model, asdict(result.config)),
    }
    return export_model(result.model, meta, Path(out_dir), attention_variant=variant, extras=extras)
