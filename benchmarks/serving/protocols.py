"""The serving benchmark's ways in: v2 JSON, binary tensor data and gRPC to one server in the same rounds, large
requests in JSON and binary, gRPC in the replica against through Serve's proxy; and the ingress's CPU per request."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.harness.server import ServerProcess
from benchmarks.models import ensure_model
from benchmarks.serving.requests import binary_requests, request_bodies, request_ids
from benchmarks.serving.rounds import grpc_loader, http_loader, interleaved, joined, load_sides, rounds
from benchmarks.serving.servers import serve, serve_config, started
from loadtest import grpc_client
from loadtest.http_client import post_bytes

PROTOCOL_RUN = "serve (default model, three ways in)"


def protocols(args, name: str) -> dict[str, dict]:
    """The default model served once, measured in the same rounds through v2 JSON over HTTP, the binary tensor data
    extension over HTTP, and gRPC (raw input contents), the same requests each way."""
    print("the default model through HTTP JSON, HTTP binary and gRPC...", flush=True)
    with serve(args.models, {"default": name}, "colocated", args) as server:
        run = started(server, [name])
        path = f"/v2/models/{name}/infer"
        binary = binary_requests(path, 64)
        messages = [grpc_client.infer_message(name, ids) for ids in request_ids(64)]
        grpc_url = f"127.0.0.1:{server.grpc_port}"
        json_ = [post_bytes(path, b) for b in request_bodies(64)]
        loaders = {
            "http json": http_loader(server.port, json_),
            "http binary": http_loader(server.port, binary),
            "grpc": grpc_loader(grpc_url, messages),
        }
        pid = server.replica_pid("ingress")  # it runs the co-located model too: ORT's CPU is in its figure
        parts = {k: load_sides(f, args.concurrency, server, k, cpu_pid=pid) for k, f in loaders.items()}
        got = rounds(interleaved(parts), args.rounds, args.seconds)
    for label in parts:
        run[label] = joined(got, label)
    return {PROTOCOL_RUN: run}


GRPC_DIRECT_RUN, GRPC_PROXY_RUN = "serve (gRPC in the replica)", "serve (gRPC through Serve's proxy)"


def grpc_proxy(args, name: str) -> dict[str, dict]:
    """The default model served twice, measured in the same rounds: directly (the ingress replica's own HTTP and
    gRPC servers, the local default) and through Serve's HTTP and gRPC proxies (`--proxy`, the cluster's way in),
    each through v2 JSON over HTTP and gRPC (raw input contents), the same requests each way."""
    print("the default model through HTTP JSON and gRPC, directly and through Serve's proxies...", flush=True)
    config = serve_config(args.models, [name], "colocated", args)
    path = f"/v2/models/{name}/infer"
    json_ = [post_bytes(path, b) for b in request_bodies(64)]
    messages = [grpc_client.infer_message(name, ids) for ids in request_ids(64)]
    with ServerProcess(config) as direct, ServerProcess(config, extra_args=["--proxy"]) as proxied:
        runs = {GRPC_DIRECT_RUN: started(direct, [name]), GRPC_PROXY_RUN: started(proxied, [name])}
        parts, where = {}, {}  # "direct grpc" -> its sides; -> (its run, "grpc")
        for run_name, way, server in ((GRPC_DIRECT_RUN, "direct", direct), (GRPC_PROXY_RUN, "proxy", proxied)):
            url = f"127.0.0.1:{server.grpc_port}"  # with --proxy, Serve's gRPC proxy's port
            loaders = {
                "http json": http_loader(server.port, json_),
                "grpc": grpc_loader(url, messages),
            }
            for label, loader in loaders.items():
                parts[f"{way} {label}"] = load_sides(loader, args.concurrency, server, f"{way} {label}")
                where[f"{way} {label}"] = (run_name, label)
        got = rounds(interleaved(parts), args.rounds, args.seconds)
    for part, (run_name, label) in where.items():
        runs[run_name][label] = joined(got, part)
    return runs


LARGE = (64, 512)  # rows x tokens of the large requests: ~200 KB of JSON text against 256 KiB of int64


LARGE_RUN = "serve (64 x 512 ids per request)"


CPU_SPLIT = {"server_cpu_ms": "all", "server_cpu_python_ms": "python", "server_cpu_native_ms": "native"}


# Seconds per figure of the large requests, at least: a few requests a second, and /proc counts a thread's CPU in
# 10 ms ticks, so a figure needs tens of requests for the protocol's ~1 ms on the event loop to show.
LARGE_SECONDS = 10.0


def large_requests(args) -> dict[str, dict]:
    """Requests of 64 x 512 ids to a small model with max_len 512, as v2 JSON and as binary tensor data, in the same
    rounds of LARGE_SECONDS or more: latency at c=1, rate and the ingress replica's CPU per request at c=4."""
    print(f"{LARGE[0]} x {LARGE[1]} ids per request, v2 JSON against binary tensor data...", flush=True)
    name = ensure_model(args.models, 4, 128, 2, max_len=LARGE[1], prefix="long")
    with serve(args.models, {"long": name}, "colocated", args) as server:
        run = started(server, [name])
        path = f"/v2/models/{name}/infer"
        json_ = [post_bytes(path, b) for b in request_bodies(8, LARGE[0], tokens=LARGE[1])]
        binary = binary_requests(path, 8, *LARGE)
        pid = server.replica_pid("ingress")
        parts = {
            "large json": load_sides(http_loader(server.port, json_), 4, server, "large json", pid),
            "large binary": load_sides(http_loader(server.port, binary), 4, server, "large binary", pid),
        }
        got = rounds(interleaved(parts), args.rounds, max(args.seconds, LARGE_SECONDS))
    for label in parts:
        run[label] = joined(got, label)
    run["decode_ms"] = decode_costs(name, json_[0], binary[0])
    return {LARGE_RUN: run}


def decode_costs(name: str, json_request: bytes, binary_request: bytes, calls: int = 50) -> dict[str, float]:
    """The median milliseconds the server's own code takes (in this process) to turn one request body into checked
    rows, as v2 JSON and as binary tensor data: what the protocol itself costs, without ORT."""
    from contract.metadata import ModelMetadata
    from service.ingress import parse_body
    from service.protocol import binary, v2

    meta = ModelMetadata(name, 4, 32, 128, 2, 260, LARGE[1], 2, ("negative", "positive"))
    json_body = json_request.split(b"\r\n\r\n", 1)[1]
    head, binary_body = binary_request.split(b"\r\n\r\n", 1)
    length = next(
        line.split(b":")[1].strip().decode()
        for line in head.split(b"\r\n")
        if line.lower().startswith(binary.HEADER.encode())
    )

    def from_json() -> None:
        v2.decode(parse_body(json_body, v2.InferRequest), meta, LARGE[0])

    def from_binary() -> None:
        header, blob = binary.split(binary_body, length)
        request = parse_body(header, v2.InferRequest)
        binary.attach(request, blob)
        v2.decode(request, meta, LARGE[0])

    out = {}
    for label, decode in (("json", from_json), ("binary", from_binary)):
        decode()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            decode()
            times.append(time.perf_counter() - start)
        out[label] = float(np.median(times) * 1e3)
    return out


def protocol_cpu(runs: dict[str, dict]) -> None:
    """The ingress replica's CPU per request under load, each way in (the protocols scenario)."""
    for run_name, labels in (
        (PROTOCOL_RUN, ("http json", "http binary", "grpc")),
        (LARGE_RUN, ("large json", "large binary")),
    ):
        ways = runs.get(run_name)
        if ways is None:
            continue
        print(f"\n{run_name}: ingress replica CPU per request under load: all; its Python threads but the model's runs")
        print("  (the event loop: protocol and handler; gRPC's poller); its native threads (ORT's pool, gRPC's, Ray's)")
        for label in labels:
            for key, where in CPU_SPLIT.items():
                if key in ways[label]:
                    each = " ".join(f"{r[key]:.2f}" for r in ways[label]["rounds"] if key in r)
                    print(f"  {label:<12} {where:<6} {ways[label][key]:8.2f} ms  (rounds: {each})")
        if "decode_ms" in ways:
            costs = ways["decode_ms"]
            print(
                f"  decoding one request into rows (in process): JSON {costs['json']:.3f} ms, "
                f"binary {costs['binary']:.3f} ms"
            )
