"""The `mha-serving` console script: one subcommand per job, each parsed by its own module's `main(argv)`.

Subcommand modules are imported only when chosen, so `serve` and `loadtest` never import torch.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with `main(argv) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "export": ("export.cli", "export head configurations to ONNX (needs the `export` extra: torch)"),
    "serve": ("service.local.launcher", "serve exported models with Ray Serve on an embedded local Ray"),
    "up": ("service.local.up", "export the default models and train the first decoder if missing, then serve them"),
    "quantize": ("export.quantize_cli", "int8 (or fp16) variants of exported models, each behind a quality gate"),
    "loadtest": ("loadtest.cli", "bounded load against a running service, per head configuration"),
    "train": ("export.train_cli", "train one head configuration on a built-in task and export it (needs torch)"),
    "sweep": ("export.sweep", "train and compare head counts: quality versus latency per h (needs torch)"),
    "attention": ("export.attention_map", "per-layer, per-head attention maps of a model on a text, as a PNG"),
    "heads": ("export.heads_cli", "which heads of a trained model matter: importance and masked accuracy per head"),
    "prune": ("export.prune_cli", "remove a trained model's least important heads and export the smaller models"),
    "prune-curve": ("export.prune_curve", "accuracy and latency against the fraction of heads pruned (needs torch)"),
    "optimize": ("optimize.cli", "the cheapest head configuration that meets an SLO here, measured; rolled out"),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: mha-serving <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`mha-serving <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"mha-serving: unknown command {command!r}; choose from {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module_name, _ = SUBCOMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or "a dependency"
        hint = " (install the export extra: pip install -e '.[export]')" if missing == "torch" else ""
        print(f"mha-serving {command}: cannot start, {missing!r} is not installed{hint}", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
