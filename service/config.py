"""The application's typed configuration: what `build_app(args)` takes, from the CLI or a Serve config's `args`.

Pydantic lives here only, at the process boundary; code inside the service gets frozen dataclasses. No torch.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.generation_config import GenerateConfig
from service.limits import RequestLimits
from service.repository_settings import RepositorySettings
from service.route_config import Route, RouteName

Backend = Literal["auto", "cpu", "gpu"]
Placement = Literal["auto", "colocated", "deployment"]
HEALTH_CHECK_PERIOD_S = 2.0  # Serve's default 10 s: a crashed replica went unnoticed (and unreplaced) that long
INGRESS_NAME = "ingress"  # the ingress deployment's name (a Serve config's `deployments` entry)
MAX_COLOCATED_THREADS = 4  # ORT's intra-op scaling flattens past a few threads at the batch sizes served here


class Autoscaling(BaseModel):
    """Ray Serve's autoscaling_config, the part we expose (replicas between min and max, by ongoing requests)."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0)


def replica_options(num_replicas: int, autoscaling: Autoscaling | None) -> dict:
    """Serve's deployment options for the replica count: fixed, or autoscaling between min and max."""
    if autoscaling is None:
        return {"num_replicas": num_replicas}
    return {"num_replicas": "auto", "autoscaling_config": autoscaling.model_dump()}


class DeploymentSettings(BaseModel):
    """Placement, resources, concurrency and batching of one model. Every field has a default."""

    model_config = ConfigDict(extra="forbid")
    backend: Backend | None = Field(None, description="this model's backend; None: the application's `backend`")
    placement: Placement = Field(
        "auto",
        description="colocated: the model's ORT session lives in the ingress replica (no Ray call per request; CPU "
        "only); deployment: its own Serve deployment (own replicas, resources, scaling; GPUs); auto: deployment for "
        "a gpu backend or for auto on a cluster with GPUs, else colocated",
    )
    num_replicas: int = Field(1, ge=1, description="fixed replica count (ignored when autoscaling is set)")
    autoscaling: Autoscaling | None = None
    num_cpus: float = Field(1.0, ge=0, description="logical CPUs Ray reserves per replica")
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs per replica; None: 0 on cpu, a share of one GPU per model on gpu/auto-with-GPU"
    )
    max_ongoing_requests: int = Field(
        64,
        ge=1,
        description="requests a replica holds at once (>= batch rows); a decoder's own deployment takes its limits "
        "from `generate` instead (its engine's queue is the only one: service/deployment.py decoder_limits)",
    )
    max_queued_requests: int = Field(
        256, ge=1, description="requests waiting for a replica; beyond it: 503 (a decoder: from `generate`)"
    )
    max_batch_size: int = Field(32, ge=1, description="rows (sequences) per ORT run")
    batch_wait_timeout_s: float = Field(0.0, ge=0, description="wait for more rows; 0: batch what queued meanwhile")
    max_concurrent_batches: int | None = Field(
        None,
        ge=1,
        description="ORT runs of this model in flight at once; on CPU a run that starts alone gets every intra-op "
        "thread, runs side by side share them out (a second session of the same file, opened at load); None: one run "
        "per intra-op thread on CPU, 1 on GPU",
    )
    inline_run_max_ms: float = Field(
        20.0,
        ge=0,
        description="on CPU, a request alone in the ingress replica that finds its model idle runs on the event "
        "loop's thread when its run is expected (from the model's last lone runs) to take at most this long; the "
        "replica answers nothing else meanwhile; 0: never",
    )
    intra_op_threads: int | None = Field(
        None,
        ge=1,
        description=f"ORT intra-op threads; None: every core (up to {MAX_COLOCATED_THREADS}) for a co-located model, "
        "num_cpus for a model in its own deployment",
    )
    light_model_threads: int | None = Field(
        1,
        ge=1,
        description="ORT intra-op threads (at most) for a light model on CPU (under service/engine.py "
        "LIGHT_MODEL_FLOPS per token), whose runs are too short for more threads to pay; None: intra_op_threads",
    )
    ort_spinning: Literal["off", "run", "always"] = Field(
        "run",
        description="what ORT's waiting intra-op threads do: run (spin only while a run is in progress), off (sleep: "
        "each parallel section wakes them), always (ORT's default: spin on after a run too, taking CPU the HTTP side "
        "needs); true/false mean always/off",
    )
    gpu_wait: Literal["auto", "spin", "yield", "block"] = Field(
        "auto", description="how a process waits for its GPU runs: CUDA's scheduling flag (service/cuda_wait.py)"
    )
    inline_on_gpu: bool = Field(False, description="lone requests inline (inline_run_max_ms) on the GPU too")
    health_check_period_s: float = Field(
        HEALTH_CHECK_PERIOD_S, gt=0, description="how often Serve checks each replica: a crashed one is replaced then"
    )

    @field_validator("ort_spinning", mode="before")
    @classmethod
    def _spinning_from_bool(cls, value: object) -> object:
        return {True: "always", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check(self) -> DeploymentSettings:
        if self.autoscaling and self.autoscaling.min_replicas > self.autoscaling.max_replicas:
            raise ValueError("autoscaling.min_replicas must be <= autoscaling.max_replicas")
        return self

    def threads(self, placement: str, processes: int = 1) -> int:
        """ORT intra-op threads in `placement` (colocated or deployment), evaluated where the model runs; co-located
        in one of `processes` serving processes, its share of the cores."""
        if self.intra_op_threads is not None:
            return self.intra_op_threads
        if placement == "colocated":
            return max(1, min((os.cpu_count() or 1) // processes, MAX_COLOCATED_THREADS))
        return max(1, int(self.num_cpus))

    def scaling(self) -> dict:
        return replica_options(self.num_replicas, self.autoscaling)


class IngressSettings(BaseModel):
    """The HTTP ingress deployment: validation, tokenization, the co-located models' engines, routing to the
    models placed in their own deployments. Its replicas scale like a model's (fixed count or autoscaling)."""

    model_config = ConfigDict(extra="forbid")
    num_replicas: int = Field(1, ge=1, description="fixed replica count (ignored when autoscaling is set)")
    autoscaling: Autoscaling | None = None
    num_cpus: float = Field(0.0, ge=0, description="logical CPUs per replica: co-located models run on these")
    num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per replica; None: for serving processes on the ingress's own ports, a share of the "
        "node's GPUs (GPUs / processes, at most 1) when a co-located model may use one; else 0",
    )
    max_ongoing_requests: int = Field(
        2048,
        ge=1,
        description="Serve's own limit per replica, kept above limits.max_in_flight so that overload "
        "gets the service's JSON 503 (with Retry-After, counted in the metrics), never Serve's plain-text one",
    )
    max_queued_requests: int = Field(2048, ge=1, description="requests Serve queues for a replica beyond that")
    health_check_period_s: float = Field(
        HEALTH_CHECK_PERIOD_S, gt=0, description="how often Serve checks each replica: a crashed one is replaced then"
    )
    coalesce: bool = Field(
        True,
        description="send the requests waiting for a model in its own deployment as one Ray call per group "
        "(service/coalescer.py); Serve's per-deployment request metrics then count groups",
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="the ingress replica serves HTTP itself on this port (its own uvicorn server; one replica); "
        "None: requests come through Serve's HTTP proxy",
    )
    host: str = Field("127.0.0.1", description="the address the ingress's own servers listen on (`port`, `grpc_port`)")
    grpc_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="the ingress replica serves the Open Inference Protocol's gRPC service and grpc.health.v1 on this "
        "port itself (one replica; the local direct mode); None: not in the replica. Behind Serve's proxies (a "
        "cluster, `serve --proxy`) gRPC comes through Serve's gRPC proxy instead: Serve's `grpc_options`, not this",
    )
    access_log: bool = Field(False, description="the ingress's own server logs a line per request (with `port`)")
    processes: int | None = Field(
        None,
        ge=1,
        description="serving processes (ingress replicas, each with its own co-located engines) sharing `port` and "
        "`grpc_port` on the node (SO_REUSEPORT: the kernel spreads connections); None: one per two cores of the "
        "node (default_processes). Only with the ingress's own ports; behind Serve's proxies, num_replicas",
    )

    @model_validator(mode="after")
    def _replicas_on_a_port(self) -> IngressSettings:
        one = self.num_replicas == 1 and self.autoscaling is None
        for key in ("port", "grpc_port"):
            if getattr(self, key) is not None and not one:
                raise ValueError(
                    f"ingress.{key}: the replicas on the ingress's own ports are `processes`; set num_replicas 1, "
                    "no autoscaling"
                )
        if self.port is not None and self.port == self.grpc_port:
            raise ValueError(f"ingress.grpc_port: {self.grpc_port} is also ingress.port; give gRPC a port of its own")
        return self

    @property
    def on_own_ports(self) -> bool:
        return self.port is not None or self.grpc_port is not None

    def process_count(self) -> int:
        """Serving processes sharing the ingress's own ports: `processes`, else the node's default."""
        return self.processes or default_processes(len(os.sched_getaffinity(0)))

    def scaling(self) -> dict:
        if self.on_own_ports:
            return {"num_replicas": self.process_count()}
        return replica_options(self.num_replicas, self.autoscaling)


def default_processes(cpus: int) -> int:
    """One serving process per two cores: each parses and answers on one while its engines' ORT threads use the
    other (and the cores the others leave idle between runs); one on a 2-core machine."""
    return max(1, cpus // 2)


class AppConfig(BaseModel):
    """`args` of `import_path: service.app:build_app`. Field names are stable: deploy/ and the CLI rely on them."""

    model_config = ConfigDict(extra="forbid")
    models_dir: str = Field("models", description="folder with one sub-folder per model (model.onnx inside)")
    models: list[str] | None = Field(None, description="serve only these folder names; None: every sub-folder")
    backend: Backend = "auto"
    deployment: DeploymentSettings = DeploymentSettings()
    overrides: dict[str, DeploymentSettings] = Field(
        default_factory=dict, description="per-model settings by name, replacing `deployment` for that model"
    )
    ingress: IngressSettings = IngressSettings()
    limits: RequestLimits = RequestLimits()
    routes: dict[RouteName, Route] = Field(
        default_factory=dict,
        description="route name -> its targets and shadow; served like a model (service/routes.py). Redeploying "
        "changes them without a restart (the ingress's user_config)",
    )
    repository: RepositorySettings = RepositorySettings()
    generate: GenerateConfig = GenerateConfig()
    server_name: str = "mha-serving"

    @model_validator(mode="after")
    def _check_overload_order(self) -> AppConfig:
        if self.limits.max_in_flight >= self.ingress.max_ongoing_requests:
            raise ValueError(
                f"limits.max_in_flight ({self.limits.max_in_flight}) must be below ingress.max_ongoing_requests "
                f"({self.ingress.max_ongoing_requests}): past Serve's limit, overload gets Serve's plain-text 503"
            )
        return self

    def settings_for(self, name: str) -> DeploymentSettings:
        return self.overrides.get(name, self.deployment)

    def placement_for(self, name: str, cluster_gpus: float) -> Literal["colocated", "deployment"]:
        """Where a model runs: its setting, or for `auto` co-located, except a model that may use a GPU behind
        Serve's proxies (its own GPU deployment there; the serving processes on their own ports get GPU shares)."""
        placement = self.settings_for(name).placement
        if placement != "auto":
            return placement
        if self.ingress.on_own_ports:
            return "colocated"
        return "deployment" if self.may_use_gpu(name, cluster_gpus) else "colocated"

    def may_use_gpu(self, name: str, cluster_gpus: float) -> bool:
        backend = self.backend_for(name)
        return backend == "gpu" or (backend == "auto" and cluster_gpus > 0)

    def backend_for(self, name: str) -> Backend:
        """A model's backend: its settings' `backend` when set (e.g. `gpu` on GPU workers), else the application's."""
        return self.settings_for(name).backend or self.backend
