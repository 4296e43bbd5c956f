"""The serving benchmark's int8 scenario: the default model's int8 variant against it, in process and served in the
same rounds, their file sizes, and the five default models served in each precision."""

from __future__ import annotations

from benchmarks.models import ensure_variant
from benchmarks.serving.bare import bare_scan, bare_sides
from benchmarks.serving.rounds import interleaved, joined, rounds, served_sides
from benchmarks.serving.servers import serve, started
from contract.metadata import MODEL_FILE

PRECISION_RUN = "serve (default fp32 and int8)"


def precisions(args, fp32: str, fp32_scan: dict, five: list[str]) -> dict[str, dict]:
    """The default model's int8 variant against it: in process and served by one server (the same rounds), their
    file sizes, then the five default models served in each precision (PSS and time to ready, one server at a time)."""
    print("int8 against fp32: the default model in process and served, then the five in each precision...", flush=True)
    int8 = ensure_variant(args.models, fp32)
    five_int8 = [ensure_variant(args.models, name) for name in five]
    int8_scan = bare_scan(args.models, int8, args.seconds)
    with serve(args.models, {"fp32": fp32, "int8": int8}, "colocated", args) as server:
        run = started(server, [fp32, int8])
        parts = {
            "bare fp32": bare_sides(args.models, fp32, fp32_scan, "bare fp32"),
            "bare int8": bare_sides(args.models, int8, int8_scan, "bare int8"),
            "fp32": served_sides(server.port, fp32, args.concurrency, server, "fp32"),
            "int8": served_sides(server.port, int8, args.concurrency, server, "int8"),
        }
        got = rounds(interleaved(parts), args.rounds, args.seconds)
    for label, scan in (("fp32", fp32_scan), ("int8", int8_scan)):
        run[label] = joined(got, label)
        run[f"bare {label}"] = {**joined(got, f"bare {label}"), "scan": scan}
    run["file_bytes"] = {
        label: (args.models / n / MODEL_FILE).stat().st_size for label, n in (("fp32", fp32), ("int8", int8))
    }
    out = {PRECISION_RUN: run}
    for label, names in (("fp32", five), ("int8", five_int8)):
        with serve(args.models, {n: n for n in names}, "colocated", args) as server:
            out[f"serve (five default models, {label})"] = started(server, [])
    return out
