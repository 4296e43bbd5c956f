"""GET /metrics on the serving port: the Prometheus exposition of this node's Ray metrics agent (what `--metrics-port`
serves), relayed as it is, as vLLM, TGI and llama.cpp's servers serve theirs beside their API (aiperf and GenAI-Perf
scrape `<url>/metrics` by default). Another node's series are on its own agent. No torch.
"""

from __future__ import annotations

import asyncio

import httpx
import ray
from fastapi import FastAPI
from starlette.responses import Response

from service.errors import NotReadyError

SCRAPE_TIMEOUT_S = 10.0
EXPOSITION = "text/plain; version=0.0.4; charset=utf-8"


def agent_url() -> str:
    """This node's metrics agent's URL; NotReadyError (503) where there is none (a process outside Ray)."""
    if not ray.is_initialized():
        raise NotReadyError("no metrics here: this process is not in a Ray cluster, whose agent exports them")
    node = ray.get_runtime_context().get_node_id()
    for entry in ray.nodes():
        if entry["NodeID"] == node and entry.get("MetricsExportPort"):
            return f"http://{entry['NodeManagerAddress']}:{entry['MetricsExportPort']}/metrics"
    raise NotReadyError("this node's Ray metrics agent has no export port")


def add_routes(app: FastAPI) -> None:
    found: list[str] = []  # the agent's URL, once asked of Ray (a blocking call, off the event loop)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """This node's Prometheus exposition, as the metrics port serves it."""
        if not found:
            found.append(await asyncio.to_thread(agent_url))
        try:
            async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
                answer = await client.get(found[0])
        except httpx.HTTPError as exc:
            raise NotReadyError(f"this node's Ray metrics agent did not answer: {exc!r}") from exc
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type", EXPOSITION))
