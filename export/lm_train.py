"""Training a decoder on the `docs-lm` corpus: random windows of the training split, AdamW with warm-up and cosine
decay (export/train.py's schedule), gradient clipping, a fixed seed; validation loss and perplexity on the held-out
documents against the uniform baseline ln(vocab). Trained decoders export through export_decoder."""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from contract.metadata import TRAINING_FILE
from export.checkpoint import CHECKPOINT_FILE
from export.convert import ExportResult, exporter_versions
from export.decoder import DecoderConfig, DecoderLM
from export.decoder_export import export_decoder
from export.docs_corpus import CORPUS, DEFAULT_VAL_FRACTION, Corpus, load_corpus
from export.train import lr_at


@dataclass(frozen=True)
class LMTrainConfig:
    heads: int = 4
    kv_heads: int | None = None  # None: heads (MHA)
    d_model: int = 64
    head_dim: int | None = None  # None: d_model // heads
    layers: int = 2
    ff_dim: int | None = None  # None: 4 * d_model
    max_len: int = 128  # the training window and the exported context length
    steps: int = 300
    batch_size: int = 32  # windows of max_len tokens per step
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0  # model init and window order
    val_fraction: float = DEFAULT_VAL_FRACTION  # of the corpus's tokens, whole documents held out
    log_every: int = 50

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "log_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {key}={value!r}")
        if self.lr <= 0 or self.grad_clip <= 0 or not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"need lr > 0, grad_clip > 0, 0 <= warmup_fraction < 1; got {self}")
        self.model_config()  # a ValueError naming the numbers when the heads do not fit

    def model_config(self) -> DecoderConfig:
        return DecoderConfig(
            d_model=self.d_model,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            layers=self.layers,
            ff_dim=self.ff_dim,
            max_len=self.max_len,
            task=CORPUS,
        )


@dataclass(frozen=True)
class LMTrainResult:
    config: LMTrainConfig
    params: int
    val_loss: float  # mean cross-entropy per token, nats
    val_perplexity: float
    uniform_loss: float  # ln(vocab_size): a model that knows nothing
    train_tokens: int
    val_tokens: int  # tokens scored in validation
    seconds: float
    history: tuple[tuple[int, float, float], ...]  # (step, mean training loss since the last line, max grad norm)
    model: DecoderLM = field(repr=False, compare=False)

    def to_json(self) -> dict[str, object]:
        out = asdict(replace(self, model=None))  # replace first: asdict would deep-copy the model
        del out["model"]
        return out


def windows(ids: torch.Tensor, starts: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (B, length) of the windows starting at `starts`."""
    index = starts[:, None] + torch.arange(length + 1)[None]  # (B, length + 1)
    chunk = ids[index]  # (B, length + 1)
    return chunk[:, :-1], chunk[:, 1:]


def _forward(model: DecoderLM, x: torch.Tensor) -> torch.Tensor:
    B, T = x.shape
    mask = torch.ones(B, T, dtype=torch.int64)  # (B, T): windows of the running text, no padding
    positions = torch.arange(T)[None].expand(B, T)  # (B, T)
    logits, _ = model(x, mask, positions)  # (B, T, V)
    return logits


@torch.no_grad()
def evaluate(model: DecoderLM, ids: torch.Tensor, length: int, batch_size: int = 64) -> tuple[float, int]:
    """Mean cross-entropy per token over the split's non-overlapping windows, and the tokens scored."""
    model.eval()
    starts = torch.arange(0, len(ids) - length, length)  # every window has its length + 1 tokens
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        x, y = windows(ids, starts[i : i + batch_size], length)
        logits = _forward(model, x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
        count += y.numel()
    return total / count, count


def train_lm(
    config: LMTrainConfig, log: Callable[[str], None] | None = print, corpus: Corpus | None = None
) -> LMTrainResult:
    """Train one decoder from scratch on docs-lm; `log` gets a progress line every log_every steps (None: silent)."""
    corpus = corpus or load_corpus(config.val_fraction)
    corpus.check(config.max_len)
    train_ids, val_ids = torch.tensor(corpus.train.ids), torch.tensor(corpus.val.ids)
    torch.manual_seed(config.seed)
    model = DecoderLM(config.model_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    g = torch.Generator().manual_seed(config.seed)
    history, losses, norms = [], [], []
    start = time.perf_counter()
    model.train()
    for step in range(config.steps):
        lr = lr_at(step, config)  # type: ignore[arg-type]  # reads steps, warmup_fraction and lr only
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - config.max_len, (config.batch_size,), generator=g)
        x, y = windows(train_ids, starts, config.max_len)  # (B, T) each
        logits = _forward(model, x)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)))
        optimizer.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"training loss became {losses[-1]} at step {step + 1} (lr={lr:.2e})")
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            history.append((step + 1, sum(losses) / len(losses), max(norms)))
            if log is not None:
                line = f"step {step + 1:>6}/{config.steps}  loss {history[-1][1]:.4f}  grad-norm {max(norms):.3f}"
                log(f"{line}  lr {lr:.2e}")
            losses, norms = [], []
    seconds = time.perf_counter() - start
    val_loss, val_tokens = evaluate(model, val_ids, config.max_len)
    uniform = math.log(model.config.vocab_size)
    if log is not None:
        log(
            f"validation: loss {val_loss:.4f} nats/token, perplexity {math.exp(val_loss):.2f} (uniform: "
            f"{uniform:.4f}, perplexity {model.config.vocab_size}); {val_tokens:,} held-out tokens, {seconds:.1f} s"
        )
    return LMTrainResult(
        config=config,
        params=model.num_parameters(),
        val_loss=val_loss,
        val_perplexity=math.exp(val_loss),
        uniform_loss=uniform,
        train_tokens=len(train_ids),
        val_tokens=val_tokens,
        seconds=seconds,
        history=tuple(history),
        model=model.eval(),
    )


def checkpoint_bytes(result: LMTrainResult) -> bytes:
    """checkpoint.pt of a trained decoder: its DecoderConfig and training settings as plain values, the state dict."""
    buffer = io.BytesIO()
    record = {
        "version": 1,
        "arch": "decoder",
        "config": asdict(result.model.config),
        "training": asdict(result.config),
        "state_dict": result.model.state_dict(),
    }
    torch.save(record, buffer)
    return buffer.getvalue()


def export_trained_lm(result: LMTrainResult, out_dir: Path) -> ExportResult:
    """Export a trained decoder through the generation parity gate, with training.json and checkpoint.pt."""
    meta = result.model.config.metadata(exporter_versions())
    corpus = load_corpus(result.config.val_fraction)
    record = {"task": CORPUS, "val_topics": list(corpus.val.topics), **result.to_json()}
    extras = {
        TRAINING_FILE: (json.dumps(record, indent=2) + "\n").encode(),
        CHECKPOINT_FILE: checkpoint_bytes(result),
    }
    return export_decoder(result.model, meta, Path(out_dir), extras=extras)
