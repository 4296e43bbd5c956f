"""The data plane: one serving process's models, routes and shadow traffic behind every transport. A transport
decodes its wire format into an InferenceRequest, is admitted (`admit`: the one place that records request metrics
and holds the in-flight limit), and encodes the InferenceResult; it never decides routing or batching, and the data
plane never sees an HTTP or gRPC object. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from contract.metadata import LOGITS, ModelMetadata
from service import attention_api, heap
from service.config import AppConfig
from service.decoder_placement import ColocatedDecoder, Decoder, not_a_classifier, not_a_decoder
from service.drain import until_idle
from service.errors import BadRequestError, ModelNotFoundError, OverCapacityError, ServiceError
from service.generate.choices import Choices
from service.generate.request import GenerateRequest, TokenEvent
from service.generation_metrics import GenerationMetrics, generation_labels
from service.inference import AttentionMap, InferenceRequest, InferenceResult, Listing, ModelStatus
from service.limits import check_generation_in_flight, check_in_flight
from service.load import Load
from service.metrics import GAUGE_REFRESH_S, IngressMetrics
from service.placement import ModelPlacement
from service.routes import RoutePlan
from service.served_models import ServedModels, ready
from service.shadow import Agreement, Mirror, ShadowTraffic
from service.validation import rows_of

logger = logging.getLogger(__name__)
GENERATION_CLOSE_S = 0.5  # of a stop's period, kept for the aborted streams' last events to go out
CLIENT_CLOSED = 499  # nginx's code for a request whose client closed the connection first (metrics only)


@dataclass(frozen=True)
class Endpoint:
    """A way in, as the metrics name it (`endpoint` label). `counted`: its transport counts each request in Load
    from its arrival, so a request that finds nothing else counted there may run inline (service/batching.py).
    `per_model`: why a route's name is not served here (404), or None where routes are."""

    name: str
    counted: bool = False
    per_model: str | None = None


@dataclass(frozen=True)
class Call:
    """An admitted request: the model that answers it (a route's pick), the route it came by, the model's status."""

    plane: DataPlane
    endpoint: Endpoint
    target: str
    route: RoutePlan | None
    status: ModelStatus

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        return await self.plane.run(self, request)

    async def attention(self, text: str, layer: int | None) -> AttentionMap:
        return await self.plane.attention_map(self, text, layer)


class DataPlane:
    def __init__(self, config: AppConfig, placements: dict[str, ModelPlacement]) -> None:
        self.limits = config.limits
        self.server_name = config.server_name
        self.models_dir = config.models_dir
        self.load = Load()
        self._generating = 0  # generation requests admitted and not yet ended (their share of max_in_flight)
        self.metrics = IngressMetrics()
        self.generation_metrics = GenerationMetrics()
        self.models = ServedModels(placements, config.routes, self.metrics, self._start_gauge_refresher)
        self._draining = False  # set by `drain` on SIGTERM: readiness answers 503 from then on
        self._shadows = ShadowTraffic(self._run_shadow, self._preempt, self.load.busy, self._record_shadow)
        self._refreshes: list[Callable[[], None]] = [
            self.metrics.refresh,
            self.generation_metrics.refresh,
            self._refresh_decoders,
        ]
        self._gauge_refresher: asyncio.Task | None = None

    def on_refresh(self, refresh: Callable[[], None]) -> None:
        """Have `refresh` (a transport's gauges) called with the data plane's own, every GAUGE_REFRESH_S."""
        self._refreshes.append(refresh)

    # ---- readiness, drain, metadata ----
    async def not_ready(self) -> str | None:
        """Why this process is not ready (draining, or models not loaded), or None when it is."""
        return "shutting down" if self._draining else await self.models.not_ready()

    def drain(self) -> int:
        """Readiness answers 503 from now on (a load balancer stops sending); requests keep being served. Returns
        the inference requests in progress (the launcher waits for them, up to limits.drain_s)."""
        self._draining = True
        return self.load.inference

    async def drained(self, until: float) -> int:
        """`drain`, then wait until no inference request is in progress or it is `until` (a time.time()); those
        left. The decoders' engines take no new sequences, let the running ones finish until shortly before `until`
        and end the rest with finish_reason "abort", so that each stream's last event still goes out."""
        self.drain()
        grace_s = until - time.time() - GENERATION_CLOSE_S
        decoders = [p for p in self.models.placements() if isinstance(p, Decoder)]
        engines = asyncio.gather(*(p.drain(grace_s) for p in decoders))
        await until_idle(lambda: self.load.inference > 0, until - time.time())
        await engines
        return self.load.inference

    async def model_status(self, name: str, version: str | None = None) -> ModelStatus:
        return await self.models.model_status(name, version)

    async def metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        return await self.models.metadata(name, version)

    async def listing(self) -> Listing:
        return await self.models.listing()

    # ---- inference ----
    @contextlib.asynccontextmanager
    async def admit(
        self, endpoint: Endpoint, name: str, route_key: str | None = None, version: str | None = None
    ) -> AsyncIterator[Call]:
        """One request to a model or a route, admitted before its body is read: refused over limits.max_in_flight
        (503), for an unknown model or version (404) or a model not ready (503). Records its latency, status code,
        rejection, in-flight and route, whatever the block inside raises; a mirrored run gives way to it."""
        models, load = self.models, self.load
        if endpoint.per_model and (plan := models.routes.get(name)) is not None:
            raise ModelNotFoundError(f"{name!r} is a route: {endpoint.per_model}; its targets: {plan.targets}")
        self._start_gauge_refresher()
        self._shadows.preempt()
        start = time.perf_counter()
        target, route = models.routes.resolve(name, route_key)
        status = await models.status(target) if target in models else None
        labels = models.labels(target, status)
        self.metrics.started(labels)
        load.inference += 1
        code, rejected = 500, False
        try:
            check_in_flight(load.inference, self.limits)
            models.check_version(name, version)
            models.placement(target)  # 404 for an unknown model
            yield Call(self, endpoint, target, route, ready(target, status))
            code = 200
        except ServiceError as exc:  # answered by the transport's one error mapping
            code, rejected = exc.status, isinstance(exc, OverCapacityError)
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away before its answer (or its stream's end)
            code = CLIENT_CLOSED
            raise
        finally:
            load.inference -= 1
            elapsed = time.perf_counter() - start  # recorded once the answer is out (this task's send is next)
            loop = asyncio.get_running_loop()
            loop.call_soon(self.metrics.finished, labels, endpoint.name, code, elapsed, rejected)
            if route is not None:
                self.metrics.routed_request(route.name, labels, code)
            if load.inference == 0:  # after the answer, too: mirrored runs, and the heap trimmed once quiet
                loop.call_soon(self._shadows.idle)
                heap.idle()

    async def generate(
        self,
        endpoint: Endpoint,
        name: str,
        request: GenerateRequest | Callable[[str], GenerateRequest | list[GenerateRequest]],
    ) -> AsyncIterator[tuple[int, TokenEvent]]:
        """A generation request's token events, each with its choice's index (a request may be several sequences:
        a list of requests, a batch's prompts and their choices); each choice's last event has a finish_reason,
        usage and timing. Admitted like any request (its 503s, a full queue, a queue timeout or generation's share of
        max_in_flight, are rejections), its sequences counted in that share, until its last event is taken; a
        consumer that stops (a client gone) ends them within a step. `request` may be a callable that builds it once
        admitted, given the model the request goes to (a route's target; its 400s counted too). Time counts from the
        request's arrival."""
        called = time.perf_counter()
        async with self.admit(endpoint, name) as call:
            placement = self.models.placement(call.target)
            if not isinstance(placement, Decoder):
                raise not_a_decoder(call.target)
            built = request(call.target) if callable(request) else request
            requests = [built] if isinstance(built, GenerateRequest) else built
            requests = [r if r.arrived is not None else dataclasses.replace(r, arrived=called) for r in requests]
            with self._generation_slot(len(requests)):
                labels = generation_labels(self.models.labels(call.target, call.status), call.status.metadata.kv_heads)
                choices = Choices.submit(placement, requests)
                records = [
                    self.generation_metrics.stream(labels, r.arrived, s.prompt_tokens)
                    for r, s in zip(requests, choices.streams, strict=True)
                ]
                try:
                    async for index, event in choices:
                        record = records[index]
                        record.taken(event)
                        yield index, event
                        record.handled()
                except (asyncio.CancelledError, GeneratorExit):  # the client went away before the last event
                    for record in records:
                        record.left()
                    raise
                finally:
                    choices.close()

    @contextlib.contextmanager
    def _generation_slot(self, sequences: int) -> Iterator[None]:
        """Generation's share of limits.max_in_flight, held for a whole stream: busy decoders leave classifiers room.
        A request of more sequences than the whole share is a 400: it could never be admitted."""
        if sequences > self.limits.generation_in_flight:
            raise BadRequestError(
                f"{sequences} sequences (prompts x n) in one request can never be admitted: generation's share of "
                f"limits.max_in_flight is {self.limits.generation_in_flight}"
            )
        check_generation_in_flight(self._generating + sequences, self.limits)
        self._generating += sequences
        try:
            yield
        finally:
            self._generating -= sequences

    def _classifier(self, call: Call) -> ModelPlacement:
        placement = self.models.placement(call.target)
        if isinstance(placement, Decoder):
            raise not_a_classifier(call.target)
        return placement

    async def run(self, call: Call, request: InferenceRequest) -> InferenceResult:
        """An admitted request's logits (B, C) from its target, mirrored when its route says so."""
        self._classifier(call)
        meta = call.status.metadata
        for output in request.outputs:
            if output != LOGITS:
                raise BadRequestError(f"unknown output {output!r}; this model has {LOGITS!r}")
        rows = rows_of(request, meta, self.limits.max_rows)
        alone = call.endpoint.counted and self.load.alone()
        result = await self.models.placement(call.target).infer(rows.ids, rows.mask, alone)
        route = call.route
        if route is not None and route.mirrors(call.target):
            self._shadows.offer(Mirror(route.name, call.target, route.shadow, rows.ids, rows.mask, result.logits))
        return InferenceResult(
            call.target, meta, call.status.backend, result.logits, result.queue_s, result.run_s, result.batch_rows
        )

    async def attention_map(self, call: Call, text: str, layer: int | None) -> AttentionMap:
        """An admitted request's attention weights of one text, per layer asked for and head (a model's only)."""
        self._classifier(call)
        meta = call.status.metadata
        ids, tokens, layers = attention_api.decode(text, layer, meta)
        result = await self.models.placement(call.target).attention(ids)
        return AttentionMap(meta, tokens, layers, attention_api.weights_of(result, meta, layers))

    # ---- shadow traffic (service/shadow.py) ----
    def _preempt(self, shadow: str) -> None:
        self.models.placement(shadow).preempt()

    async def _run_shadow(self, mirror: Mirror):
        """The shadow's (n, C) logits for a mirrored request, on spare capacity (None: a client came first); raises
        when the shadow cannot take the request (not ready, or beyond its max_len or vocabulary)."""
        meta = ready(mirror.shadow, await self.models.status(mirror.shadow)).metadata
        if mirror.ids.shape[1] > meta.max_len or int(mirror.ids.max(initial=0)) >= meta.vocab_size:
            raise BadRequestError(f"the request is beyond shadow model {mirror.shadow!r}'s max_len or vocabulary")
        return await self.models.placement(mirror.shadow).spare_infer(mirror.ids, mirror.mask)

    def _record_shadow(self, mirror: Mirror, outcome: str, agreement: Agreement | None) -> None:
        primary, shadow = self.models.labels(mirror.primary), self.models.labels(mirror.shadow)
        self.metrics.shadowed(mirror.route, primary, shadow, outcome, agreement)

    # ---- gauges ----
    def _refresh_decoders(self) -> None:
        """Each co-located decoder's running and waiting requests and KV cache usage, from its engine in this process
        (every GAUGE_REFRESH_S); a decoder in a deployment of its own has its engine, and these gauges, in its
        replica (service/deployment.py)."""
        for name in self.models.names:
            placement = self.models.placement(name)
            if not isinstance(placement, ColocatedDecoder) or placement.engine is None:
                continue
            labels = self.models.labels(name)
            if not labels["heads"]:  # not seen ready yet: no head configuration to label it with
                continue
            decoder = generation_labels(labels, placement.engine.meta.kv_heads)
            self.generation_metrics.engines.set(decoder, placement.engine.state())

    def _start_gauge_refresher(self) -> None:
        if self._gauge_refresher is None:
            self._gauge_refresher = asyncio.get_running_loop().create_task(self._refresh_gauges())

    async def _refresh_gauges(self) -> None:
        while True:
            for refresh in self._refreshes:
                try:
                    refresh()
                except Exception:  # one failed export must not stop the counters and gauges for good
                    logger.exception("refreshing the metrics failed; trying again in %g s", GAUGE_REFRESH_S)
            await asyncio.sleep(GAUGE_REFRESH_S)
