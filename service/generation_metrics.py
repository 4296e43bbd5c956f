"""Prometheus metrics of token generation per decoder, named as vLLM names them under our prefix so its dashboards'
queries carry over: declared here, recorded by the data plane (service/dataplane.py) and, for the engine's gauges, by
the process that holds the engine. Labels: a model's head configuration and its key/value heads. No torch.
"""

from __future__ import annotations

import time

from ray.serve.metrics import Counter, Gauge, Histogram

from service.generate.output import OPENAI_FINISH_REASONS
from service.generate.request import TokenEvent
from service.generate.scheduler import SchedulerState
from service.metrics import LATENCY_BUCKETS_S, MODEL_LABELS

GENERATION_LABELS = (*MODEL_LABELS, "kv_heads")
# A generation request's whole life and its wait in a decoder's queue: seconds to minutes (long streams, a queue
# bounded by queue_timeout_s, 30 s by default).
REQUEST_BUCKETS_S = [*LATENCY_BUCKETS_S, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0]
# Why a generation request ended, as OpenAI and vLLM's `finished_reason` name it: a fixed set, the label's values.
FINISHED_REASONS = ("stop", "length", "abort")


def generation_labels(labels: dict[str, str], kv_heads: int) -> dict[str, str]:
    """A decoder's labels: its model labels and its key/value heads."""
    return {**labels, "kv_heads": str(kv_heads)}


class GenerationMetrics:
    """What the ingress sees of each generation request: time to first token, inter-token latency, end to end,
    queue time, tokens and how it ended; the engines of its co-located decoders."""

    def __init__(self) -> None:
        self.first_token = Histogram(
            "mha_time_to_first_token_seconds",
            description="Time from a generation request's arrival (its head) to its first token handed to its client "
            "(written, for a stream): reading, queue, prefill and the first write.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=GENERATION_LABELS,
        )
        self.inter_token = Histogram(
            "mha_inter_token_latency_seconds",
            description="Time between consecutive tokens of one generation request.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=GENERATION_LABELS,
        )
        self.generated = Counter(
            "mha_generation_tokens_total",
            description="Tokens generated (EOS and the tokens of a stop string included).",
            tag_keys=GENERATION_LABELS,
        )
        self.prompt = Counter(
            "mha_prompt_tokens_total",
            description="Prompt tokens of the generation requests that started.",
            tag_keys=GENERATION_LABELS,
        )
        self.e2e = Histogram(
            "mha_e2e_request_latency_seconds",
            description="Time from a generation request's arrival at its decoder's engine to its last event (one per "
            "request that ended with a finished_reason, a client gone included).",
            boundaries=REQUEST_BUCKETS_S,
            tag_keys=GENERATION_LABELS,
        )
        self.queue_time = Histogram(
            "mha_request_queue_time_seconds",
            description="Time a generation request waited in its decoder's queue: arrival to the start of its "
            "prefill (one per request that started).",
            boundaries=REQUEST_BUCKETS_S,
            tag_keys=GENERATION_LABELS,
        )
        self.succeeded = Counter(
            "mha_request_success_total",
            description="Generation requests that ended with a finished_reason: stop (a stop string or EOS), "
            "length (max_tokens), abort (the client went away, or the server stopped it).",
            tag_keys=(*GENERATION_LABELS, "finished_reason"),
        )
        self.engines = EngineGauges()  # the co-located decoders' engines, in this process
        self._tokens: dict[tuple[str, ...], list[int]] = {}  # generation labels -> [generated, prompt] since refresh

    def token_event(self, labels: dict[str, str], tokens: int, since_s: float, first: bool) -> None:
        """One event of a generation stream with `tokens` new tokens, `since_s` after the previous one (after the
        request's arrival for the `first` with a token); generation_labels."""
        if not tokens:
            return
        (self.first_token if first else self.inter_token).observe(since_s, tags=labels)
        counts = self._tokens.setdefault(tuple(labels.values()), [0, 0])
        counts[0] += tokens

    def queued(self, labels: dict[str, str], seconds: float) -> None:
        """A generation request's prefill started `seconds` after its arrival; generation_labels."""
        self.queue_time.observe(seconds, tags=labels)

    def generation_finished(self, labels: dict[str, str], finished_reason: str, seconds: float) -> None:
        """A generation request ended with `finished_reason` (one of FINISHED_REASONS) `seconds` after its arrival;
        generation_labels. Few enough per second (one per request, not per token) to be counted at once."""
        if finished_reason not in FINISHED_REASONS:
            raise ValueError(f"finished_reason {finished_reason!r} is not one of {FINISHED_REASONS}")
        self.e2e.observe(seconds, tags=labels)
        self.succeeded.inc(1, tags={**labels, "finished_reason": finished_reason})

    def stream(self, labels: dict[str, str], arrived: float, prompt_tokens: int) -> StreamRecord:
        """The recorder of one stream's events (generation_labels; `arrived`: perf_counter of its head)."""
        return StreamRecord(self, labels, arrived, prompt_tokens)

    def prompt_tokens(self, labels: dict[str, str], tokens: int) -> None:
        counts = self._tokens.setdefault(tuple(labels.values()), [0, 0])
        counts[1] += tokens

    def refresh(self) -> None:
        """Add the tokens counted since the last refresh to the counters, as IngressMetrics adds the requests it
        counted (a Ray counter increment per event costs the event loop)."""
        tokens, self._tokens = self._tokens, {}
        for key, (generated, prompt) in tokens.items():
            tags = dict(zip(GENERATION_LABELS, key, strict=True))
            for counter, count in ((self.generated, generated), (self.prompt, prompt)):
                if count:  # a Ray counter takes only increments > 0
                    counter.inc(count, tags=tags)


class StreamRecord:
    """One generation stream's metrics, recorded as its consumer takes each event: the first token's time once the
    consumer has handled it (a stream's transport: written) and comes back for more, or leaves; the abort of a
    stream whose consumer leaves before its last event."""

    def __init__(self, metrics: GenerationMetrics, labels: dict[str, str], arrived: float, prompt_tokens: int) -> None:
        self._metrics, self._labels, self._arrived, self._prompt = metrics, labels, arrived, prompt_tokens
        self._last = 0.0  # the engine's time of the last event with tokens (0: none yet)
        self._first = 0  # the first token event's tokens, until its time is recorded
        self._finished = False

    def taken(self, event: TokenEvent) -> None:
        metrics, labels, tokens = self._metrics, self._labels, len(event.token_ids)
        if self._last:
            metrics.token_event(labels, tokens, event.time - self._last, False)
        elif tokens:
            self._first = tokens
        if tokens:
            self._last = event.time
        if event.queued_s is not None:  # its prefill ran: a request that timed out waiting has none
            metrics.queued(labels, event.queued_s)
            metrics.prompt_tokens(labels, self._prompt)
        if event.finish_reason is not None:
            self._finished = True
            metrics.generation_finished(labels, OPENAI_FINISH_REASONS[event.finish_reason], event.timing.total_s)

    def handled(self) -> None:
        if self._first:
            self._metrics.token_event(self._labels, self._first, time.perf_counter() - self._arrived, True)
            self._first = 0

    def left(self) -> None:
        self.handled()
        if not self._finished:
            self._metrics.generation_finished(self._labels, "abort", time.perf_counter() - self._arrived)


class EngineGauges:
    """A decoder engine's running and waiting requests and KV cache bytes, set every GAUGE_REFRESH_S by the process
    that holds the engine: the ingress for a co-located decoder (DataPlane), the decoder's own replica otherwise
    (service/deployment.py). Each process's series add up in Prometheus."""

    def __init__(self) -> None:
        self.running = Gauge(
            "mha_num_requests_running",
            description="Generation requests in a decoder's running batch, in this process.",
            tag_keys=GENERATION_LABELS,
        )
        self.waiting = Gauge(
            "mha_num_requests_waiting",
            description="Generation requests queued for room in a decoder's KV budget, in this process.",
            tag_keys=GENERATION_LABELS,
        )
        self.kv_usage = Gauge(
            "mha_kv_cache_usage_perc",
            description="Share of a decoder's KV cache budget in bytes that its cache held at the peak of its last "
            "step (0 to 1).",
            tag_keys=GENERATION_LABELS,
        )
        self.kv_bytes = Gauge(
            "mha_kv_cache_bytes",
            description="Bytes a decoder's KV cache held at the peak of its last step: the batch's past and present, "
            "padding, rows that left and the copies of a join included (0 once it holds nothing).",
            tag_keys=GENERATION_LABELS,
        )
        self.preemptions = Counter(
            "mha_num_preemptions",
            description="Running generation requests sent back to the queue for KV room, their tokens so far "
            "recomputed later (vLLM's num_preemptions).",
            tag_keys=GENERATION_LABELS,
        )
        self._preempted: dict[tuple[str, ...], int] = {}  # each engine's count when last set

    def set(self, labels: dict[str, str], state: SchedulerState) -> None:
        """A decoder's engine now (`engine.state()`); generation_labels."""
        self.running.set(state.running, tags=labels)
        self.waiting.set(state.waiting, tags=labels)
        self.kv_usage.set(state.kv_cache_usage, tags=labels)
        self.kv_bytes.set(state.kv_bytes, tags=labels)
        key = tuple(labels.values())
        if (new := state.preemptions - self._preempted.get(key, 0)) > 0:  # a Ray counter takes increments > 0
            self.preemptions.inc(new, tags=labels)
        self._preempted[key] = state.preemptions
