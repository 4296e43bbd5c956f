"""A user's own model built with our layer: `mha-serving export --model package.module:factory`.

The factory protocol, precisely:

- `package.module:factory` names a callable: `factory` is an attribute of the module (dots reach nested attributes,
  `pkg.mod:Builder.build`). The current directory is importable, so a `mymodels.py` beside you works.
- The factory takes either one argument or none. With one, it is called once per head count in `--heads` with an
  `export.model.EncoderConfig` (heads, d_model, head_dim, layers, ff_dim, max_len, vocab_size, num_classes, labels,
  all from the flags); with none, it is called once and the model fixes its own configuration (`--heads` is then a
  usage error). The global torch seed is set to `--seed` before every call. It returns a `torch.nn.Module`.
- The module follows the serving contract: `forward(input_ids, attention_mask)`, both int64 `[batch, seq]`
  (1 = token, 0 = padding), returns one float32 tensor `logits` `[batch, num_classes]`, for every batch >= 1 and
  1 <= seq <= max_len. It contains at least one `export.attention.MultiHeadAttention`, all with the same h and
  head_dim: they give the metadata's heads, head_dim, d_model, and layers (their count). vocab_size, max_len,
  num_classes, labels and ff_dim come from the module's `config` attribute where it has them, else from the flags.
- With `--attention`, the module also has `forward_with_attention(input_ids, attention_mask)` returning
  `(logits, weights)` with weights float32 `[batch, layers, h, seq, seq]`, as `EncoderClassifier` does.

A factory that raises, a return value that is not a module, or a module that breaks the contract fails the export
of that configuration (exit status 1) with a one-line message; the parity gate checks the outputs' names and shapes.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from contract.metadata import MetadataError, ModelMetadata, config_name
from contract.settings import UsageError
from contract.tokenizer import VOCAB_SIZE
from export.attention import MultiHeadAttention
from export.model import EncoderConfig


class FactoryError(RuntimeError):
    """The factory raised, or returned something that does not follow the contract (exit status 1)."""


@dataclass(frozen=True)
class Factory:
    spec: str  # "package.module:factory", as given
    fn: Callable[..., object]
    takes_config: bool

    def build(self, config: EncoderConfig | None) -> nn.Module:
        try:
            module = self.fn(config) if self.takes_config else self.fn()
        except Exception as exc:
            detail = str(exc).splitlines()[0] if str(exc) else "no message"
            raise FactoryError(f"factory {self.spec} raised {type(exc).__name__}: {detail}") from exc
        if not isinstance(module, nn.Module):
            raise FactoryError(
                f"factory {self.spec} returned an object of type {type(module).__name__}, not a torch.nn.Module"
            )
        return module


def resolve(spec: str) -> Factory:
    """`package.module:factory` -> Factory; UsageError naming the part that cannot be found."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise UsageError(f"--model must look like package.module:factory, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UsageError(f"--model {spec}: no module named {exc.name!r} (is it on PYTHONPATH?)") from exc
        raise UsageError(f"--model {spec}: importing {module_name} failed: no module named {exc.name!r}") from exc
    except Exception as exc:
        raise UsageError(f"--model {spec}: importing {module_name} raised {type(exc).__name__}: {exc}") from exc
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--model {spec}: {module_name} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"--model {spec}: {attr_path} is a {type(target).__name__}, not a callable factory")
    return Factory(spec, target, _takes_config(spec, target))


def _takes_config(spec: str, fn: Callable[..., object]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False  # a builtin without a signature: call it without arguments
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 1:
        raise UsageError(f"--model {spec}: the factory must take one argument (an EncoderConfig) or none")
    return bool(required) or any(p.kind == p.VAR_POSITIONAL for p in params)


def describe(
    module: nn.Module, spec: str, defaults: dict[str, object], name_prefix: str, exporter: dict[str, str]
) -> ModelMetadata:
    """The metadata of a user's module: heads from its MultiHeadAttention layers, the rest from `config` or flags.

    `defaults` holds the flags' vocab_size, max_len, num_classes and labels, used where the module has no `config`.
    """
    layers = [m for m in module.modules() if isinstance(m, MultiHeadAttention)]
    if not layers:
        raise FactoryError(f"{spec} returned a model without an export.attention.MultiHeadAttention layer")
    shapes = sorted({(m.h, m.head_dim, m.d_model) for m in layers})
    if len(shapes) > 1:
        raise FactoryError(f"{spec} returned a model whose attention layers differ (h, head_dim, d_model): {shapes}")
    heads, head_dim, d_model = shapes[0]
    own = getattr(module, "config", None)
    values = {key: getattr(own, key, None) for key in ("vocab_size", "max_len", "num_classes", "labels")}
    values = {key: defaults[key] if value is None else value for key, value in values.items()}
    ff_dim = getattr(own, "resolved_ff_dim", None) or getattr(own, "ff_dim", None) or 0  # 0: unknown
    try:
        return ModelMetadata(
            name=config_name(heads, d_model, head_dim, prefix=name_prefix),
            heads=heads,
            head_dim=head_dim,
            d_model=d_model,
            layers=len(layers),
            vocab_size=values["vocab_size"],
            max_len=values["max_len"],
            num_classes=values["num_classes"],
            labels=tuple(values["labels"]),
            tokenizer="byte-v1" if values["vocab_size"] == VOCAB_SIZE else "ids",
            ff_dim=ff_dim if isinstance(ff_dim, int) else 0,
            exporter=exporter,
        )
    except (MetadataError, TypeError) as exc:
        raise FactoryError(f"{spec} returned a model whose configuration is inconsistent: {exc}") from exc


class WithAttention(nn.Module):
    """Export wrapper for `--attention`: outputs (logits, attention_weights) from `forward_with_attention`."""

    def __init__(self, module: nn.Module, spec: str) -> None:
        super().__init__()
        if not callable(getattr(module, "forward_with_attention", None)):
            raise FactoryError(f"--attention: the model from {spec} has no forward_with_attention(input_ids, mask)")
        self.model = module

    def forward(self, input_ids, attention_mask):
        return self.model.forward_with_attention(input_ids, attention_mask)
