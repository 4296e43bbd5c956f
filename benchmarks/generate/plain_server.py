"""The generation benchmark's plain server: FastAPI + uvicorn + one ORT session, no Ray, no batching: each request
generated alone by the bare greedy loop (benchmarks.generate.loops), its tokens streamed as server-sent events in
OpenAI's completion chunk shape, so that the service's client measures both. Run as
`python -m benchmarks.generate.plain_server --models DIR --name NAME --port P`, or by `PlainGenerateServer`. No torch.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from benchmarks.generate.loops import greedy_steps
from benchmarks.harness.module_server import ModuleServer
from service.generate.session import load_decoder


def _chunk(cid: str, model: str, text: str, finish: str | None, usage: dict | None) -> bytes:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    body = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model}
    return b"data: " + json.dumps({**body, "choices": [choice], "usage": usage}).encode() + b"\n\n"


def make_app(models_dir: str, name: str, backend: str, threads: int) -> FastAPI:
    runtime = load_decoder(models_dir, name, backend, threads)
    app = FastAPI()

    @app.post("/openai/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = json.loads(await request.body())
        prompt = np.asarray([body["prompt"]], np.int64)  # (1, T): token ids as they are
        new = int(body["max_tokens"])
        cid = f"cmpl-{uuid.uuid4().hex}"

        # A plain iterator: Starlette runs each step on its thread pool, so requests generate side by side, each
        # alone (ORT releases the GIL while it runs).
        def stream() -> Iterator[bytes]:
            for step, tokens in enumerate(greedy_steps(runtime, prompt, new), 1):
                last = step == new
                counts = {"prompt_tokens": prompt.shape[1], "completion_tokens": step}
                usage = {**counts, "total_tokens": prompt.shape[1] + step} if last else None
                text = chr(int(tokens[0]) % 128)  # one character a token: the client times chunks, not text
                yield _chunk(cid, name, text, "length" if last else None, usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generate.plain_server")
    p.add_argument("--models", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    app = make_app(args.models, args.name, args.backend, args.threads)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


class PlainGenerateServer(ModuleServer):
    """This server in a subprocess, as a side of the rounds: `with PlainGenerateServer(models, name, ...) as s:`."""

    def __init__(self, models_dir: Path, name: str, backend: str, threads: int) -> None:
        args = ["--models", str(models_dir), "--name", name, "--backend", backend, "--threads", str(threads)]
        super().__init__("benchmarks.generate.plain_server", args, ready_timeout_s=120)


if __name__ == "__main__":
    raise SystemExit(main())
