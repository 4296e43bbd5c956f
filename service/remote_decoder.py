"""A decoder in its own Serve deployment (service/deployment.py DecoderServer), as the ingress sees it: the same
`status`, `submit` and `drain` as a co-located one (service/decoder_placement.py), its token events streamed through the
deployment's handle. No torch.
"""

from __future__ import annotations

import dataclasses
import time

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from contract.decoder_metadata import DecoderMetadata
from service.decoder_placement import Decoder
from service.drain import until_idle
from service.errors import NotReadyError
from service.generate import ABORT, GenerateRequest, Timing, TokenEvent, Usage
from service.inference import ModelStatus
from service.placement import replica_status
from service.remote_calls import CallCancelled, answer_of


class RemoteStream:
    """One sequence's events from the decoder's replica, each stamped with this process's clock as it arrives (the
    inter-token latency the ingress sees; the replica may be on another node). Leaving it cancels the call, which
    ends the sequence in the replica; `abort` ends it here with a last event whose finish_reason is "abort".
    `arrived`: when the request's head arrived, this process's perf_counter."""

    def __init__(self, name: str, response: DeploymentResponseGenerator, prompt_tokens: int, arrived: float) -> None:
        self._name, self._response, self.prompt_tokens = name, response, prompt_tokens
        self._arrived = arrived
        self._first: TokenEvent | None = None  # the first event with a token: its queue time and first-token time
        self._last: TokenEvent | None = None
        self._tokens = 0
        self._done = self._aborted = False

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await answer_of(self._name, self._response.__anext__())
        except CallCancelled:
            if not self._aborted:
                raise
            self._done = True
            return self._abort_event()
        except BaseException:
            self.cancel()
            raise
        event = dataclasses.replace(event, time=time.perf_counter())
        self._tokens += len(event.token_ids)
        if self._first is None and event.token_ids:
            self._first = event
        self._last = event
        self._done = event.finish_reason is not None
        return event

    def cancel(self) -> None:
        """End the sequence in the replica (its generator is closed there)."""
        if not self._done:
            self._done = True
            self._response.cancel()

    def abort(self) -> None:
        """End it with a last event saying "abort" (a stop past its grace), as a co-located engine does."""
        if not self._done:
            self._aborted = True
            self._response.cancel()

    @property
    def done(self) -> bool:
        return self._done

    def _abort_event(self) -> TokenEvent:
        now = time.perf_counter()
        first_s = self._first.time - self._arrived if self._first is not None else 0.0
        queued_s = (self._first.queued_s or 0.0) if self._first is not None else 0.0
        step = self._last.step + 1 if self._last is not None else 0
        timing = Timing(self._arrived, queued_s, first_s, now - self._arrived)
        return TokenEvent((), "", now, step, ABORT, Usage(self.prompt_tokens, self._tokens), timing)


class RemoteDecoder(Decoder):
    """The decoder's deployment; the prompt is encoded and checked here (the same 400s as co-located, before any
    Ray call) and sent as token ids."""

    placement = "deployment"

    def __init__(self, name: str, handle: DeploymentHandle) -> None:
        self.name = name
        self._handle = handle.options(stream=True)
        self._status_handle = handle
        self._meta: DecoderMetadata | None = None  # from the last status: admission asks it before every submit
        self._streams: set[RemoteStream] = set()

    async def status(self) -> ModelStatus:
        """Ask the decoder's replica (live), as a classifier's deployment is asked."""
        status = await replica_status(self.name, self._status_handle)
        if status.ready and isinstance(status.metadata, DecoderMetadata):
            self._meta = status.metadata
        return status

    def submit(self, request: GenerateRequest) -> RemoteStream:
        """Raises, with nothing sent: PromptError, ContextLengthError, SamplingParamsError (400); NotReadyError (no
        status seen yet). The replica gets the request's age, not its arrival: perf_counter is this process's own."""
        if self._meta is None:
            raise NotReadyError(f"model {self.name!r} is not ready: its replica has not answered yet")
        checked = request.checked(self._meta)
        now = time.perf_counter()
        arrived = now if request.arrived is None else request.arrived
        call = dataclasses.replace(checked, arrived=None)
        stream = RemoteStream(
            self.name, self._handle.generate.remote(call, now - arrived), len(checked.prompt), arrived
        )
        self._streams = {s for s in self._streams if not s.done}
        self._streams.add(stream)
        return stream

    async def drain(self, grace_s: float) -> None:
        """Let the streams in progress finish for up to `grace_s`, then end the rest with finish_reason "abort"."""
        await until_idle(self.busy, grace_s)
        for stream in self._streams:
            stream.abort()

    def busy(self) -> bool:
        return any(not s.done for s in self._streams)

    def state(self) -> None:
        """Its engine's state lives in its replicas' processes."""
        return None

    def close(self) -> None:
        """Nothing held here: its replicas go with a redeploy."""
