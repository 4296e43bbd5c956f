"""The generation engine of one decoder model: its ORT session, scheduler, step runner and output processing, driven
by one thread of its own (schedule -> execute -> update), so the event loop only submits requests and reads events.
No torch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from service import heap
from service.drain import until_idle
from service.errors import GenerationFailedError, QueueTimeoutError
from service.generate.output import CANCELLED, LENGTH, TextOutput
from service.generate.plan import Schedule
from service.generate.request import GenerateRequest, TokenEvent
from service.generate.runner import StepRunner
from service.generate.scheduler import Scheduler, SchedulerState
from service.generate.sequence import Sequence
from service.generate.session import DecoderRuntime, load_decoder
from service.generate.settings import GenerationSettings
from service.generate.slot_runner import SlotRunner
from service.generate.stream import TokenStream
from service.thread_names import ENGINE, RUNS, name_thread, threads_named

Outbox = list[tuple[Sequence, TokenEvent | BaseException]]  # one step's events (or errors), by sequence
CLOSE_WAIT_S = 10.0  # how long `close` waits for the step in flight and the last events


class GenerationEngine:
    """Construct with a loaded DecoderRuntime (or `open` a model folder); the engine's thread starts at once and
    sleeps while there is nothing to do. `submit` and `generate` are called on an event loop; `state` anywhere."""

    def __init__(self, runtime: DecoderRuntime, settings: GenerationSettings) -> None:
        self.runtime, self.meta, self.settings = runtime, runtime.meta, settings
        self.name = runtime.meta.name
        itemsize = np.dtype(runtime.cache_dtype).itemsize
        self._runner: StepRunner | SlotRunner
        if self.meta.cache_in_place:
            self._runner = SlotRunner(runtime, settings)
            limits = settings.limits(runtime.meta, itemsize, self._runner.cache.block)
        else:
            self._runner = StepRunner(runtime, settings.io_binding)
            limits = settings.limits(runtime.meta, itemsize)
        self._scheduler = Scheduler(self.name, limits)
        self._thread = threading.Thread(target=self._loop, name=f"{RUNS}{self.name}", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, models_dir: str | Path, name: str, settings: GenerationSettings) -> GenerationEngine:
        """Load `models_dir/name` (ModelFileError, BackendError say why not) and start its engine."""
        with threads_named(f"{ENGINE}{name}"):  # the threads ORT starts for this model, named after it
            runtime = load_decoder(models_dir, name, settings.backend, settings.threads, settings.spinning)
        return cls(runtime, settings)

    def submit(self, request: GenerateRequest) -> TokenStream:
        """Queue `request` and return its stream at once. Raises, with nothing queued: PromptError, ContextLengthError,
        SamplingParamsError (400); ModelQueueFullError (503, Retry-After); NotReadyError (503: draining or closed).
        Call it on the event loop that will read the stream."""
        request = request.checked(self.meta)
        output = TextOutput(request.params, self.meta.eos_id, self.meta.takes_text)
        seq = Sequence(request.prompt, request.params, output, arrived=request.arrived)  # type: ignore[arg-type]
        stream = TokenStream(seq, self._scheduler)
        self._scheduler.add(seq)
        return stream

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """`submit`, then its events; the sequence ends when the consumer stops (breaks, aclose, task cancelled)."""
        stream = self.submit(request)
        try:
            async for event in stream:
                yield event
        finally:
            stream.cancel()

    def state(self) -> SchedulerState:
        return self._scheduler.state()

    async def drain(self, grace_s: float) -> None:
        """Take no new requests; let the queued and running ones finish for up to `grace_s`, then end the rest with
        finish_reason "abort" (a last event each, never a silent cut)."""
        self._scheduler.drain()
        if not await until_idle(self._busy, grace_s):
            self._scheduler.abort_all()
            await until_idle(self._busy, CLOSE_WAIT_S)  # the step in flight ends, then the next one ends them

    def close(self) -> None:
        """Abort what is left and stop the engine's thread (after `drain` for a graceful stop)."""
        self._scheduler.abort_all(close=True)
        self._thread.join(CLOSE_WAIT_S)

    def _busy(self) -> bool:
        state = self._scheduler.state()
        return bool(state.running or state.waiting or state.paused)

    def _loop(self) -> None:
        name_thread(f"{RUNS}{self.name}")
        while (plan := self._scheduler.schedule()) is not None:
            try:
                tokens = self._runner.execute(plan)
                self._update(plan, tokens)
            except Exception as exc:  # ORT failed (or a bug): this step's sequences end with it, the engine goes on
                self._fail(plan, exc)
            if not self._runner.peak_bytes and not self._busy():  # it holds nothing now: the heap is trimmed once quiet
                heap.idle()

    def _update(self, plan: Schedule, tokens: list[tuple[Sequence, int]]) -> None:
        """Each sequence's new token through its output processor into an event; finished ones leave."""
        now = time.perf_counter()
        outbox, finished = self._ended(plan, now), []
        for seq, token in tokens:
            if not seq.params.max_tokens:  # its prompt only, for its logprobs: no token
                outbox.append((seq, seq.event(plan.step, (), "", now, LENGTH)))
                finished.append(seq)
                continue
            seq.next_input = token
            seq.generated.append(token)
            delta = seq.output.add(token)
            outbox.append((seq, seq.event(plan.step, (token,), delta.text, now, delta.finish_reason)))
            if delta.finish_reason is not None:
                finished.append(seq)
        self._scheduler.update(finished, self._runner.released, self._runner.peak_bytes)
        _publish(outbox)

    def _fail(self, plan: Schedule, exc: Exception) -> None:
        self._runner.reset()  # the cache may be half-updated: every running sequence is in this plan and ends
        running = list(plan.running)
        self._scheduler.update(running, [*running, *self._runner.released], 0)  # the cache is dropped whole
        error = GenerationFailedError(f"model {self.name!r}: a decoding step failed: {exc}")
        _publish(self._ended(plan, time.perf_counter()) + [(seq, error) for seq in running])

    def _ended(self, plan: Schedule, now: float) -> Outbox:
        """The last events of sequences ended from outside, and the errors of those that waited too long."""
        step = plan.step
        outbox: Outbox = [(seq, seq.event(step, (), seq.output.flush(), now, seq.stop_reason)) for seq in plan.left]
        limit = self.settings.queue_timeout_s
        outbox += [(seq, QueueTimeoutError(self.name, now - seq.arrived, limit)) for seq in plan.expired]
        return outbox


def _publish(outbox: Outbox) -> None:
    """Hand one step's events to their consumers' event loops: one call per loop, not per event."""
    by_loop: dict[asyncio.AbstractEventLoop, Outbox] = {}
    for seq, item in outbox:
        by_loop.setdefault(seq.loop, []).append((seq, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # that loop is closed: nobody is left to read; the sequences end at the next step
            for seq, _ in items:
                seq.stop_reason = seq.stop_reason or CANCELLED


def _deliver(items: Outbox) -> None:
    for seq, item in items:
        seq.sink.put(item)
