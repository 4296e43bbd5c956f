"""Prometheus metrics per head configuration, recorded where the work happens (ingress and model replicas).

Exported through Ray's metrics pipeline (prefixed `ray_`, with Serve's deployment/replica/application tags added), so
series add up across replicas and nodes. Every series carries the head configuration labels. No torch.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

from contract.metadata import ModelMetadata
from service.shadow import Agreement

MODEL_LABELS = ("model", "heads", "head_dim", "d_model", "precision", "backend")
UNKNOWN_MODEL = "_unknown"  # label for requests naming no served model: keeps label cardinality bounded
# On Ray's OpenTelemetry metrics path a gauge value not set again within two export intervals (10 s each by default)
# vanishes from the scrape, so the ingress re-sets its gauges this often (service/local/ray_env.py picks the path).
GAUGE_REFRESH_S = 1.0

# Seconds. Bare ORT on 2 CPU cores runs the small model in ~0.4 ms and the default one in ~6 ms at batch 1; an HTTP
# request through Serve adds milliseconds; overload pushes into seconds. Dense from 0.5 ms to 50 ms, sparse above.
LATENCY_BUCKETS_S = [
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
]  # fmt: skip
BATCH_SIZE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # rows per ORT run (max_batch_size defaults to 32)
TOKEN_BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]  # padded B * T per run

# A route's shadow metrics: the route, the model that answered and the shadow, each with its head count.
SHADOW_LABELS = ("route", "primary", "primary_heads", "shadow", "shadow_heads")
# Absolute logit differences: near 0 for a faithful variant (int8: ~1e-2), order 1 and above for a different model.
LOGIT_DIFF_BUCKETS = [1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]


def model_labels(meta: ModelMetadata | None, backend: str, name: str = UNKNOWN_MODEL) -> dict[str, str]:
    """The head configuration labels of one model (empty strings where the model is unknown or not loaded)."""
    if meta is None:
        return {"model": name, "heads": "", "head_dim": "", "d_model": "", "precision": "", "backend": backend}
    return {
        "model": meta.name,
        "heads": meta.heads_label,  # "8"; a pruned model whose layers differ: per layer, "8,6,4,5"
        "head_dim": str(meta.head_dim),
        "d_model": str(meta.d_model),
        "precision": meta.precision,
        "backend": backend,
    }


def _labels_of(key: tuple[str, ...]) -> dict[str, str]:
    """The labels of a model_labels() key (its values, in MODEL_LABELS order)."""
    return dict(zip(MODEL_LABELS, key, strict=True))


class IngressMetrics:
    """What the ingress sees of each HTTP request: latency end to end, status, overload, in-flight."""

    def __init__(self) -> None:
        request_keys = (*MODEL_LABELS, "endpoint", "code")
        self.latency = Histogram(
            "mha_request_latency_seconds",
            description="End-to-end request latency at the ingress (validation, queue, batch, ORT, response).",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=(*MODEL_LABELS, "endpoint"),
        )
        self.requests = Counter(
            "mha_requests_total",
            description="Inference requests by model, endpoint and HTTP status.",
            tag_keys=request_keys,
        )
        self.rejected = Counter(
            "mha_rejected_requests_total",
            description="Requests refused with 503 because a model's queue was full (over capacity).",
            tag_keys=MODEL_LABELS,
        )
        self.in_flight = Gauge(
            "mha_inflight_requests",
            description="Inference requests in progress at this ingress replica.",
            tag_keys=MODEL_LABELS,
        )
        self.info = Gauge(
            "mha_model_info",
            description="1 per served model, its full configuration as labels.",
            tag_keys=(*MODEL_LABELS, "layers", "vocab_size", "max_len", "num_classes", "ff_dim", "tokenizer", "task"),
        )
        self.routed = Counter(
            "mha_route_requests_total",
            description="Requests to a route by the target model that answered and HTTP status.",
            tag_keys=("route", *MODEL_LABELS, "code"),
        )
        self.mirrored = Counter(
            "mha_shadow_requests_total",
            description="A route's requests mirrored to its shadow model, by outcome: compared, dropped (no spare "
            "capacity), preempted (a client's request came first), failed.",
            tag_keys=(*SHADOW_LABELS, "outcome"),
        )
        self.shadow_rows = Counter(
            "mha_shadow_rows_total",
            description="Rows compared between the answering model and the shadow model; agreed: whether the shadow "
            "predicted the same label (true) or not (false).",
            tag_keys=(*SHADOW_LABELS, "agreed"),
        )
        self.logit_diff = Histogram(
            "mha_shadow_max_abs_logit_diff",
            description="The largest absolute logit difference between answer and shadow, per compared request.",
            boundaries=LOGIT_DIFF_BUCKETS,
            tag_keys=SHADOW_LABELS,
        )
        self.repository = Counter(
            "mha_repository_requests_total",
            description="Requests to the model repository API (index, load, unload) by HTTP status, refusals "
            "included (401 without the token).",
            tag_keys=("action", "code"),
        )
        self._in_flight: dict[tuple[str, ...], int] = {}
        self._info: list[dict[str, str]] = []
        # Counts since the last `refresh`, added to the counters there: a Ray counter increment per request cost
        # ~3 % of the ingress's CPU at c=32 (py-spy); Ray exports every few seconds anyway.
        self._requests: dict[tuple[tuple[str, ...], str, int], int] = {}
        self._rejected: dict[tuple[str, ...], int] = {}
        self._routed: dict[tuple[str, tuple[str, ...], int], int] = {}
        self._mirrored: dict[tuple[tuple[str, ...], str], int] = {}
        self._compared: dict[tuple[str, ...], list[int]] = {}  # shadow key -> [rows, agreeing rows]

    def model_info(self, meta: ModelMetadata, backend: str) -> None:
        keys = ("layers", "vocab_size", "max_len", "num_classes", "ff_dim")
        extra = {k: str(getattr(meta, k, 0)) for k in keys}  # a decoder has no classes: 0
        tags = {**model_labels(meta, backend), **extra, "tokenizer": meta.tokenizer, "task": meta.task}
        self._info.append(tags)
        self.info.set(1, tags=tags)

    def model_gone(self, labels: dict[str, str]) -> None:
        """A model no longer served here (unloaded, or loaded again): its info series goes to 0 and is not set again."""
        for tags in [t for t in self._info if all(t[k] == v for k, v in labels.items())]:
            self._info.remove(tags)
            self.info.set(0, tags=tags)

    def repository_request(self, action: str, code: int) -> None:
        """One request to the model repository API (index, load, unload), by status: refusals included."""
        self.repository.inc(1, tags={"action": action, "code": str(code)})

    def refresh(self) -> None:
        """Set every gauge again (see GAUGE_REFRESH_S): model info and the in-flight counts; add the requests
        counted since the last refresh to the counters."""
        for tags in self._info:
            self.info.set(1, tags=tags)
        for key, count in self._in_flight.items():
            self.in_flight.set(count, tags=_labels_of(key))
        requests, self._requests = self._requests, {}
        for (key, endpoint, code), count in requests.items():
            self.requests.inc(count, tags={**_labels_of(key), "endpoint": endpoint, "code": str(code)})
        rejected, self._rejected = self._rejected, {}
        for key, count in rejected.items():
            self.rejected.inc(count, tags=_labels_of(key))
        routed, self._routed = self._routed, {}
        for (route, key, code), count in routed.items():
            self.routed.inc(count, tags={"route": route, **_labels_of(key), "code": str(code)})
        mirrored, self._mirrored = self._mirrored, {}
        for (key, outcome), count in mirrored.items():
            self.mirrored.inc(count, tags={**dict(zip(SHADOW_LABELS, key, strict=True)), "outcome": outcome})
        compared, self._compared = self._compared, {}
        for key, (rows, agreeing) in compared.items():
            tags = dict(zip(SHADOW_LABELS, key, strict=True))
            for agreed, count in (("true", agreeing), ("false", rows - agreeing)):
                if count:  # a Ray counter takes only increments > 0
                    self.shadow_rows.inc(count, tags={**tags, "agreed": agreed})

    def started(self, labels: dict[str, str]) -> None:
        """Counted here, exported by `refresh` (a gauge set per request cost ~5 % of the ingress's CPU)."""
        key = tuple(labels.values())
        self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def finished(self, labels: dict[str, str], endpoint: str, code: int, seconds: float, rejected: bool) -> None:
        """One request done: `rejected` when it was refused for capacity (a 503 that is not "not ready"); the
        counters see it at the next `refresh`."""
        key = tuple(labels.values())
        self._in_flight[key] = max(0, self._in_flight.get(key, 0) - 1)
        counted = (key, endpoint, code)
        self._requests[counted] = self._requests.get(counted, 0) + 1
        if rejected:
            self._rejected[key] = self._rejected.get(key, 0) + 1
        self.latency.observe(seconds, tags={**labels, "endpoint": endpoint})

    def routed_request(self, route: str, labels: dict[str, str], code: int) -> None:
        """One request to `route`, answered by the model of `labels` with `code`."""
        counted = (route, tuple(labels.values()), code)
        self._routed[counted] = self._routed.get(counted, 0) + 1

    def shadowed(
        self, route: str, primary: dict[str, str], shadow: dict[str, str], outcome: str, agreement: Agreement | None
    ) -> None:
        """One mirrored request's outcome, and for a compared one its rows, agreeing rows and largest difference."""
        key = (route, primary["model"], primary["heads"], shadow["model"], shadow["heads"])
        self._mirrored[(key, outcome)] = self._mirrored.get((key, outcome), 0) + 1
        if agreement is not None:
            counts = self._compared.setdefault(key, [0, 0])
            counts[0] += agreement.rows
            counts[1] += agreement.agreeing
            tags = dict(zip(SHADOW_LABELS, key, strict=True))
            self.logit_diff.observe(agreement.max_abs_diff, tags=tags)


class ReplicaMetrics:
    """What a model replica sees of each batch: queue wait per request, rows, padded tokens, ORT run time."""

    def __init__(self) -> None:
        self.queue_wait = Histogram(
            "mha_queue_wait_seconds",
            description="Time a request waited in the replica before its batch started running.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=MODEL_LABELS,
        )
        self.batch_size = Histogram(
            "mha_batch_size",
            description="Rows per ONNX Runtime run (dynamic batching).",
            boundaries=BATCH_SIZE_BUCKETS,
            tag_keys=MODEL_LABELS,
        )
        self.batch_tokens = Histogram(
            "mha_batch_tokens",
            description="Padded tokens (rows x longest sequence) per ONNX Runtime run.",
            boundaries=TOKEN_BUCKETS,
            tag_keys=MODEL_LABELS,
        )
        self.inference = Histogram(
            "mha_inference_seconds",
            description="ONNX Runtime run time per batch.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=MODEL_LABELS,
        )

    def batch(self, labels: dict[str, str], rows: int, tokens: int, run_s: float, queue_waits: list[float]) -> None:
        self.batch_size.observe(rows, tags=labels)
        self.batch_tokens.observe(tokens, tags=labels)
        self.inference.observe(run_s, tags=labels)
        for wait in queue_waits:
            self.queue_wait.observe(wait, tags=labels)
