"""Clients that never read, against the memory and sockets the serving process keeps for them: a fresh `mha-serving
serve` with one decoder; 8 streams on `generate_stream` whose 256 KiB `id` is echoed in every event, from sockets with
a 4 KiB receive buffer that never read; a normal completion meanwhile; then how long until the server has closed
every one of their sockets, and the ingress replica's RSS then against its size before they came.

    python -m benchmarks.stalled_clients [--send-timeout-s 30] [--models runs/bench-models]

The bar (issue 63): every socket closed by send_timeout_s + 5 s, RSS back within 10 MB, the completion answered.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import httpx

from benchmarks.generate.cli import add_decoder_options, ensure_decoder
from benchmarks.harness.processes import memory_kib
from benchmarks.harness.server import ServerProcess

CLIENTS = 8
ID_BYTES = 256 << 10
TCP_ESTABLISHED = 1  # struct tcp_info's tcpi_state


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stalled_clients", description=__doc__.splitlines()[0])
    add_decoder_options(p)
    p.set_defaults(max_len=320)
    p.add_argument("--send-timeout-s", type=float, default=30.0, help="limits.send_timeout_s")
    p.add_argument("--max-tokens", type=int, default=200, help="each stalled stream's")
    args = p.parse_args(argv)
    if args.send_timeout_s <= 0 or not 1 <= args.max_tokens < args.max_len - 1:
        p.error("--send-timeout-s > 0 and --max-tokens within the context")
    return args


def never_reading(port: int, path: str, body: dict) -> socket.socket:
    """A socket that sends its request and reads nothing, with a 4 KiB receive buffer."""
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it advertises
    sock.connect(("127.0.0.1", port))
    sock.sendall(head.encode() + b"\r\n" + payload)
    return sock


def established(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == TCP_ESTABLISHED


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = ensure_decoder(args)
    config = {"models_dir": str(args.models.resolve()), "models": [name], "backend": "cpu"}
    config["limits"] = {"send_timeout_s": args.send_timeout_s}
    body = {"text_input": "x", "id": "i" * ID_BYTES, "parameters": {"max_tokens": args.max_tokens, "ignore_eos": True}}
    completion = {"model": name, "prompt": "x", "max_tokens": 16}
    with ServerProcess(config) as server, httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as http:
        pid = server.replica_pid("ingress")
        assert http.post("/openai/v1/completions", json=completion).status_code == 200  # warm
        time.sleep(2.0)
        before = memory_kib(pid, "Rss")
        started = time.monotonic()
        socks = [never_reading(server.port, f"/v2/models/{name}/generate_stream", body) for _ in range(CLIENTS)]
        try:
            answered = http.post("/openai/v1/completions", json=completion)
            answer_s = time.monotonic() - started
            peak = memory_kib(pid, "Rss")
            deadline = started + args.send_timeout_s + 30
            while any(established(s) for s in socks) and time.monotonic() < deadline:
                peak = max(peak, memory_kib(pid, "Rss"))
                time.sleep(0.1)
            closed_s = time.monotonic() - started
            still = sum(established(s) for s in socks)
        finally:
            for sock in socks:
                sock.close()
        time.sleep(2.0)  # the last streams' ends
        after = memory_kib(pid, "Rss")
    print(f"{name}: {CLIENTS} never-reading streams of {args.max_tokens} tokens with a {ID_BYTES >> 10} KiB id")
    print(f"a completion meanwhile: {answered.status_code} after {answer_s:.2f} s")
    print(f"their sockets closed by the server after {closed_s:.1f} s (send_timeout_s {args.send_timeout_s:g})")
    print(f"still open: {still}; ingress RSS before {before / 1024:.0f} MiB")
    print(f"ingress RSS peak +{(peak - before) / 1024:.1f} MiB, after +{(after - before) / 1024:.1f} MiB")
    ok = answered.status_code == 200 and still == 0 and closed_s <= args.send_timeout_s + 5
    return 0 if ok and (after - before) * 1024 <= 10e6 else 1


if __name__ == "__main__":
    raise SystemExit(main())
