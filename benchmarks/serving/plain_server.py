"""The serving benchmark's plain server: FastAPI + uvicorn + one ORT session, no Ray, no batching, answering the same
v2 JSON; run as `python -m benchmarks.serving.plain_server --models DIR --name NAME --port P`, or started by
`PlainServer` in a subprocess. No torch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from benchmarks.harness.module_server import ModuleServer
from service.runtime import load_runtime


def make_app(models_dir: str, name: str, threads: int) -> FastAPI:
    runtime = load_runtime(models_dir, name, "cpu", threads)
    app = FastAPI()

    @app.post("/v2/models/{model}/infer")
    async def infer(model: str, request: Request) -> Response:  # ORT runs inline: one request at a time
        body = json.loads(await request.body())
        tensor = body["inputs"][0]
        ids = np.asarray(tensor["data"], dtype=np.int64).reshape(tensor["shape"])  # flat -> (B, T)
        logits = runtime.run(ids, np.ones_like(ids))
        out = {"model_name": name, "outputs": [{"name": "logits", "datatype": "FP32", "shape": list(logits.shape)}]}
        out["outputs"][0]["data"] = logits.ravel().tolist()
        return Response(json.dumps(out), media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.plain_server")
    p.add_argument("--models", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    app = make_app(args.models, args.name, args.threads)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


class PlainServer(ModuleServer):
    """This server in a subprocess (one thread), as a side of the rounds: `with PlainServer(models, name) as s:`."""

    def __init__(self, models_dir: Path, name: str) -> None:
        args = ["--models", str(models_dir), "--name", name, "--threads", "1"]
        super().__init__("benchmarks.serving.plain_server", args, ready_timeout_s=60)


if __name__ == "__main__":
    raise SystemExit(main())
