"""What `mha-serving serve` prints once the server is up: where to send requests (HTTP, gRPC), the metrics, and
each model with its head configuration. No torch."""

from __future__ import annotations

import argparse

REPORT_TIMEOUT_S = 10.0  # the start report's model list: a reload sent meanwhile waits for it


def model_list(base: str) -> tuple[list[dict], str | None]:
    """The models as GET /v1/models lists them, or why there is no list. Asked through the public port, so a flood
    that holds the connection cap or overloads the server from its first second answers it; the server is up and
    must stay up whatever this gets."""
    import httpx

    try:
        answer = httpx.get(f"{base}/v1/models", timeout=REPORT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return [], f"{type(exc).__name__}: {exc}"
    try:
        body = answer.json()
    except ValueError:
        body = None
    if answer.status_code != 200 or not isinstance(body, dict) or not isinstance(body.get("models"), list):
        said = body.get("error") if isinstance(body, dict) else None
        return [], f"HTTP {answer.status_code}: {said or answer.text[:200]}"
    return body["models"], None


def report(args: argparse.Namespace) -> None:
    models, unlisted = model_list(f"http://{args.host}:{args.port}")
    everywhere = args.host in ("0.0.0.0", "::")  # a URL with it cannot be opened: show loopback, and say so
    shown = "127.0.0.1" if everywhere else args.host
    base = f"http://{shown}:{args.port}"
    print(f"mha-serving: serving on {base}")
    if everywhere:
        print(f"  (listening on every interface, {args.host}: from elsewhere use this machine's name or address)")
    for label, path in [
        ("v2 (Open Inference Protocol)", "/v2/models/{name}/infer"),
        ("simple JSON", "/v1/models/{name}/predict"),
        ("completions (OpenAI, decoders)", "/openai/v1/completions"),
        ("generate (OIP, decoders)", "/v2/models/{name}/generate_stream"),
        ("model list", "/v1/models"),
        ("OpenAPI docs", "/docs"),
    ]:
        print(f"  {label:<30} {base}{path}")
    if args.grpc_port:
        print(f"  {'gRPC (inference, grpc.health.v1)':<30} {shown}:{args.grpc_port}")
        if args.proxy and not everywhere:
            print(f"  (Serve's gRPC proxy listens on every interface, not only {args.host})")
    print(f"  {'metrics (Prometheus)':<30} http://{shown}:{args.metrics_port}/metrics")
    if unlisted is not None:
        print(f"  models: not listed at start ({unlisted}); GET {base}/v1/models lists them")
    for m in models:
        if m["ready"]:
            kv = f" kv_heads={m['kv_heads']} context={m['context_length']}" if m.get("arch") == "decoder" else ""
            heads = f"h={m['heads']}{kv} head_dim={m['head_dim']} d_model={m['d_model']}"
            print(f"  model {m['name']}: {heads} on {m['backend']}")
        else:
            print(f"  model {m['name']}: NOT READY: {m['error']}")
    print("Ctrl-C to stop.", flush=True)
