"""Locust users for mha-serving, driving the same endpoints with the same bodies as `mha-serving loadtest`.

Locust is not a dependency of the project: `pip install locust`, then for example
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 30s
Settings come from environment variables: MHA_MODELS (`all` or names, comma-separated), MHA_SEQ_LEN (`fixed:32`),
MHA_BATCH_SIZE (1), MHA_PROTOCOL (`simple`, `v2` or `v2-binary`), MHA_RATE (requests/s per user; unset: back to back).
Locust's statistics are grouped per model (the request name is the model's name and protocol).
"""

from __future__ import annotations

import itertools
import os

from locust import HttpUser, constant, constant_throughput, task

from loadtest.discovery import parse_model, select_models
from loadtest.workload import SeqLenSpec, build_bodies, endpoint

MODELS = os.environ.get("MHA_MODELS", "all")
SEQ_LEN = SeqLenSpec.parse(os.environ.get("MHA_SEQ_LEN", "fixed:32"))
BATCH_SIZE = int(os.environ.get("MHA_BATCH_SIZE", "1"))
PROTOCOL = os.environ.get("MHA_PROTOCOL", "simple")
RATE = float(os.environ.get("MHA_RATE", "0"))
HEADERS = {"content-type": "application/json"}


class ModelUser(HttpUser):
    """Discovers the models once, then cycles through them, one request per task."""

    wait_time = constant_throughput(RATE) if RATE > 0 else constant(0)

    def on_start(self) -> None:
        listing = self.client.get("/v1/models", name="/v1/models").json()
        models = select_models([parse_model(e) for e in listing["models"]], MODELS)
        plan = []
        for model in models:
            bodies, _ = build_bodies(SEQ_LEN, model.max_len, BATCH_SIZE, (PROTOCOL,))
            plan.append((model.name, endpoint(PROTOCOL, model.name), bodies[PROTOCOL]))
        self.requests = itertools.cycle(
            [(n, path, bodies[i]) for i in range(8) for n, path, bodies in plan]
        )  # models in turn

    @task
    def infer(self) -> None:
        name, path, body = next(self.requests)
        headers = HEADERS | dict(body.headers)
        self.client.post(path, data=body.content, headers=headers, name=f"{name} ({PROTOCOL})")
