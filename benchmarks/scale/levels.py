"""What a scaling run measures: its levels (a precision served by N processes), planned from the command line."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from service.config import DeploymentSettings

PRECISIONS = ("fp32", "int8", "fp16")


@dataclass(frozen=True, order=True)
class Level:
    precision: str
    processes: int
    variant: str = ""  # the name of a --variant (settings changed from the defaults); "": the defaults

    @property
    def label(self) -> str:
        """One spelling for a level: its sides, its server and its row are named by it."""
        return f"{self.precision} x{self.processes}" + (f" {self.variant}" if self.variant else "")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """ "block:gpu_wait=block,inline_on_gpu=true" -> ("block", {"gpu_wait": "block", "inline_on_gpu": "true"}): a
    name and the model settings (service/config.py DeploymentSettings) its levels' servers change; ValueError for a
    malformed one, or a setting the service would refuse (its own check, the one its config file gets)."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not name or " " in name:
        raise ValueError(f"--variant: {text!r} is not NAME:KEY=VALUE[,KEY=VALUE...] (NAME without spaces)")
    settings = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--variant {name}: {item!r} is not KEY=VALUE")
        settings[key.strip()] = value.strip()
    try:
        DeploymentSettings.model_validate(settings)
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"--variant {name}: {why}") from None
    return name, settings


def default_processes(cores: int) -> list[int]:
    """Powers of two up to the machine's cores: 1, 2, 4, ... (1 on one core)."""
    out, n = [], 1
    while n <= max(1, cores):
        out.append(n)
        n *= 2
    return out


def parse_processes(text: str) -> list[int]:
    """ "1,2,4,8" -> [1, 2, 4, 8], sorted, once each; ValueError naming an entry that is not a positive count."""
    counts = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--processes: {item!r} is not a positive number of processes")
        counts.add(int(item))
    if not counts:
        raise ValueError("--processes: no count given")
    return sorted(counts)


def parse_precisions(text: str, backend: str) -> list[str]:
    """ "fp32,fp16" -> ["fp32", "fp16"] in the order given; ValueError for an unknown one, or fp16 on the CPU
    (ORT runs fp16 graphs on CUDA only)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item not in PRECISIONS:
            raise ValueError(f"--precision: {item!r} is none of {', '.join(PRECISIONS)}")
        if item == "fp16" and backend != "gpu":
            raise ValueError("--precision fp16 runs on the GPU only: add --backend gpu")
        if item not in out:
            out.append(item)
    if not out:
        raise ValueError("--precision: none given")
    return out


def plan(precisions: list[str], processes: list[int], variants: list[str] | None = None) -> list[Level]:
    """Every precision at every process count in every variant ("": the defaults), fewest processes first within
    a precision and variant."""
    return [Level(p, n, v) for p in precisions for v in variants or [""] for n in sorted(processes)]
