"""The serving benchmark's placement scenarios: `mha-serving serve` co-located beside bare ORT, the --versus tree's
server and the plain FastAPI + ORT server in the same rounds; each model in its own deployment (and the --versus
tree's); the default model among the five default models against alone."""

from __future__ import annotations

import contextlib

from benchmarks.serving.bare import bare_sides
from benchmarks.serving.plain_server import PlainServer
from benchmarks.serving.rounds import Side, interleaved, joined, rounds, served_sides
from benchmarks.serving.servers import serve, started
from benchmarks.serving.stages import profiled


def side_by_side(args, names: dict[str, str], scans: dict[str, dict], bare: dict) -> tuple[dict | None, dict]:
    """The co-located server (with --versus, the other tree's too) and the plain server beside bare ORT, in the same
    rounds, each pair the bar compares measured one right after the other: the plain server's figures (None unless
    it ran) and the servers' runs; the bare sides' rounds go into `bare`."""
    plain, runs = None, {}
    with contextlib.ExitStack() as stack:
        parts: dict[str, dict[str, Side]] = {}  # what each model's sides are, in the order pairs are compared
        if "colocated" in args.scenarios:
            print("mha-serving serve, placement colocated...", flush=True)
            colocated = stack.enter_context(serve(args.models, names, "colocated", args))
            runs["serve (colocated)"] = started(colocated, list(names.values()))
            for label, name in names.items():
                parts[f"bare {label}"] = bare_sides(args.models, name, scans[label], f"bare {label}")
                parts[f"serve {label}"] = served_sides(
                    colocated.port, name, args.concurrency, colocated, f"serve {label}"
                )
        if args.versus is not None and "colocated" in args.scenarios:
            print(f"mha-serving serve from {args.versus}, placement colocated...", flush=True)
            before = stack.enter_context(serve(args.models, names, "colocated", args, tree=args.versus))
            runs["versus (colocated)"] = started(before, list(names.values()))
            for label, name in names.items():
                parts[f"versus {label}"] = served_sides(before.port, name, args.concurrency, before, f"versus {label}")
        if "plain" in args.scenarios:
            print("plain FastAPI + ORT...", flush=True)
            baseline = stack.enter_context(PlainServer(args.models, names["small"]))
            parts["plain small"] = served_sides(
                baseline.port, names["small"], args.concurrency, baseline, "plain small"
            )
        if parts:
            order = (  # the pairs compared adjacent
                *("bare small", "serve small", "versus small", "plain small"),
                *("bare default", "serve default", "versus default"),
            )
            got = rounds(interleaved({k: parts[k] for k in order if k in parts}), args.rounds, args.seconds)
            plain = joined(got, "plain small") if "plain small" in parts else None
            if "colocated" in args.scenarios:
                for label in names:
                    bare[label].update(joined(got, f"bare {label}"))
                    runs["serve (colocated)"][label] = joined(got, f"serve {label}")
                    if f"versus {label}" in parts:
                        runs["versus (colocated)"][label] = joined(got, f"versus {label}")
                if args.profile:
                    others = [baseline] if plain else []
                    others += [before] if "versus (colocated)" in runs else []
                    profiled(colocated, names, args, runs["serve (colocated)"], others)
    return plain, runs


def deployment(args, names: dict[str, str]) -> dict[str, dict]:
    """Each model in its own deployment (with --versus, the other tree's too), the models measured in the same
    rounds, each model's pair measured one right after the other."""
    print("mha-serving serve, placement deployment...", flush=True)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(serve(args.models, names, "deployment", args))
        runs = {"serve (deployment)": started(server, list(names.values()))}
        parts = {label: served_sides(server.port, n, args.concurrency, server, label) for label, n in names.items()}
        if args.versus is not None:
            print(f"mha-serving serve from {args.versus}, placement deployment...", flush=True)
            before = stack.enter_context(serve(args.models, names, "deployment", args, tree=args.versus))
            runs["versus (deployment)"] = started(before, list(names.values()))
            for label, name in names.items():
                parts[f"versus {label}"] = served_sides(before.port, name, args.concurrency, before, f"versus {label}")
        order = [key for label in names for key in (label, f"versus {label}") if key in parts]  # pairs adjacent
        got = rounds(interleaved({key: parts[key] for key in order}), args.rounds, args.seconds)
        runs["serve (deployment)"].update({label: joined(got, label) for label in names})
        if "versus (deployment)" in runs:
            runs["versus (deployment)"].update({label: joined(got, f"versus {label}") for label in names})
        if args.profile:
            others = [before] if "versus (deployment)" in runs else []
            profiled(server, names, args, runs["serve (deployment)"], others)
    return runs


def five_models(args, names: dict[str, str], five: list[str]) -> dict[str, dict]:
    """The default model served among the five default models (the others idle), against served alone, in the same
    rounds; PSS and time to ready of the five before the second server starts."""
    print("mha-serving serve, the five default models, then the default model alone beside them...", flush=True)
    default = {"default": names["default"]}
    together = {"busy": names["default"], **{f"idle-{i}": n for i, n in enumerate(five) if n != names["default"]}}
    with serve(args.models, together, "colocated", args) as five_server:
        five_run = started(five_server, [names["default"]])  # PSS and ready before a second server starts
        with serve(args.models, default, "colocated", args) as alone_server:
            alone_run = started(alone_server, [names["default"]])
            parts = {
                "alone": served_sides(alone_server.port, names["default"], args.concurrency, alone_server, "alone"),
                "busy": served_sides(five_server.port, names["default"], args.concurrency, five_server, "busy"),
            }
            got = rounds(interleaved(parts), args.rounds, args.seconds)
    alone_run["default"], five_run["busy"] = joined(got, "alone"), joined(got, "busy")
    return {"serve (default model alone)": alone_run, "serve (five default models)": five_run}
