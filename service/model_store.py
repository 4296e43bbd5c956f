"""Model folders on disk and the contract check of a loaded model (names, dtypes, ranks, metadata).

Reads metadata through ONNX Runtime's own view of the file (no second parse, no `onnx` import). No torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.metadata import (
    ARCH_KEY,
    ATTENTION_MASK,
    CONFIG_FILE,
    DECODER,
    INPUT_IDS,
    LOGITS,
    MODEL_FILE,
    MetadataError,
    ModelMetadata,
)
from service.errors import ModelFileError

INT64 = "tensor(int64)"
FLOAT32 = "tensor(float)"


def find_models(models_dir: str | Path, names: list[str] | None = None) -> list[str]:
    """Model names (sub-folder names) under `models_dir`, sorted; a folder without model.onnx is still listed.

    Listing broken folders on purpose: each gets its own deployment, which then reports why it cannot serve.
    """
    root = Path(models_dir)
    if not root.is_dir():
        raise ModelFileError(f"models folder {str(root)!r} does not exist (export models with `mha-serving export`)")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if names is not None:
        unknown = sorted(set(names) - set(found))
        if unknown:
            raise ModelFileError(f"models {unknown} not found in {str(root)!r} (found: {found})")
        found = sorted(names)
    if not found:
        raise ModelFileError(f"no model folders in {str(root)!r} (export models with `mha-serving export`)")
    return found


def is_decoder(models_dir: str | Path, name: str) -> bool:
    """Whether the folder holds a decoder (its config.json says arch=decoder): served by a generation engine."""
    try:
        return json.loads((Path(models_dir) / name / CONFIG_FILE).read_text()).get(ARCH_KEY) == DECODER
    except (OSError, ValueError, AttributeError):
        return False  # no readable config: loaded as a classifier, whose load says what is wrong


def model_file(models_dir: str | Path, name: str) -> Path:
    path = Path(models_dir) / name / MODEL_FILE
    if not path.is_file():
        raise ModelFileError(f"model {name!r}: {name}/{MODEL_FILE} is missing")
    return path


def without_paths(message: str, folder: Path) -> str:
    """`message` for a client: the model folder's server path replaced by the folder's name (the model's)."""
    return message.replace(str(folder), folder.name)


def check_contract(name: str, props: dict[str, str], inputs: list, outputs: list) -> ModelMetadata:
    """The metadata of a loaded model, after checking it against the contract; ModelFileError names what is wrong.

    `inputs` / `outputs` are ONNX Runtime NodeArg-like objects (name, type, shape).
    """
    if props.get(ARCH_KEY) == DECODER:  # a language model (export --decoder, train --task docs-lm)
        raise ModelFileError(
            f"model {name!r} is a decoder (arch=decoder): not a classifier; decoders are served by a "
            "generation engine, chosen by the folder's config.json (arch=decoder), which is missing or says otherwise"
        )
    try:
        meta = ModelMetadata.from_props(props)
    except MetadataError as exc:
        raise ModelFileError(f"model {name!r}: {exc}") from exc
    if meta.name != name:
        raise ModelFileError(f"model folder {name!r} holds a model whose metadata name is {meta.name!r}")
    problems = []
    got_inputs = [i.name for i in inputs]
    if got_inputs != [INPUT_IDS, ATTENTION_MASK]:
        problems.append(f"inputs are {got_inputs}, expected {[INPUT_IDS, ATTENTION_MASK]}")
    for arg in inputs:
        if arg.type != INT64 or len(arg.shape) != 2:
            problems.append(f"input {arg.name!r} is {arg.type} of rank {len(arg.shape)}, expected int64 rank 2")
    logits = [o for o in outputs if o.name == LOGITS]
    if not logits:
        problems.append(f"no output {LOGITS!r} (outputs: {[o.name for o in outputs]})")
    else:
        out = logits[0]
        width = out.shape[-1] if out.shape else None
        if out.type != FLOAT32 or len(out.shape) != 2:
            problems.append(f"output {LOGITS!r} is {out.type} of rank {len(out.shape)}, expected float32 rank 2")
        elif isinstance(width, int) and width != meta.num_classes:
            problems.append(f"output {LOGITS!r} has {width} classes, metadata says num_classes={meta.num_classes}")
    if problems:
        raise ModelFileError(f"model {name!r} breaks the input/output contract: " + "; ".join(problems))
    return meta
