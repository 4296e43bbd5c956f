"""A decoder's placement: its generation engine (service/generate/) in this serving process, as every serving
process holds one. It answers `status` like a classifier's placement; classification asked of it is a 400 naming
the generation routes. No torch.
"""

from __future__ import annotations

import numpy as np

from service.errors import BadRequestError, ModelFileError, NotReadyError
from service.generate import GenerateRequest, GenerationEngine, GenerationSettings, SchedulerState, TokenStream
from service.inference import ModelStatus

GENERATION_ROUTES = "/openai/v1/completions or /v2/models/{name}/generate"


def not_a_classifier(name: str) -> BadRequestError:
    return BadRequestError(f"model {name!r} is a decoder: use {GENERATION_ROUTES.replace('{name}', name)}")


def not_a_decoder(name: str) -> BadRequestError:
    return BadRequestError(
        f"model {name!r} is a classifier: it generates no text; use /v2/models/{name}/infer "
        f"or /v1/models/{name}/predict"
    )


class Decoder:
    """A decoder's placement, wherever its engine runs (`isinstance(placement, Decoder)`: it generates); what only
    classifiers do is a 400 naming the generation routes."""

    name: str

    async def infer(self, ids: np.ndarray, mask: np.ndarray, alone: bool = False):
        raise not_a_classifier(self.name)

    async def spare_infer(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        raise not_a_classifier(self.name)

    def preempt(self) -> None:
        """Nothing to stop: a decoder is never a shadow."""

    async def attention(self, ids: np.ndarray):
        raise not_a_classifier(self.name)


class ColocatedDecoder(Decoder):
    """The decoder's engine lives in the ingress replica; `generate` submits to it."""

    placement = "colocated"

    def __init__(self, name: str, engine: GenerationEngine | None, error: str = "") -> None:
        """`engine` None: the decoder could not be loaded (`error` says why); it is served as not ready."""
        self.name, self.engine = name, engine
        if engine is None:
            self._status = ModelStatus(name, False, error)
        else:
            runtime = engine.runtime
            self._status = ModelStatus(name, True, runtime.reason, runtime.backend, runtime.threads, engine.meta)

    @classmethod
    def open(cls, models_dir: str, name: str, settings: GenerationSettings) -> ColocatedDecoder:
        """The decoder's engine, loaded (blocks); a broken folder, or a KV budget that cannot hold one context,
        leaves it not ready, saying why, as a classifier's broken file does (BackendError is raised)."""
        try:
            return cls(name, GenerationEngine.open(models_dir, name, settings))
        except (ModelFileError, ValueError) as exc:
            return cls(name, None, str(exc))

    async def status(self) -> ModelStatus:
        return self._status

    def submit(self, request: GenerateRequest) -> TokenStream:
        if self.engine is None:  # admission refuses a model that is not ready first
            raise NotReadyError(f"model {self.name!r} is not ready: {self._status.reason}")
        return self.engine.submit(request)

    async def drain(self, grace_s: float) -> None:
        if self.engine is not None:
            await self.engine.drain(max(0.0, grace_s))

    def state(self) -> SchedulerState | None:
        """Its engine's running and waiting sequences and KV reservation now; None when it could not be loaded."""
        return None if self.engine is None else self.engine.state()

    def busy(self) -> bool:
        state = self.state()
        return state is not None and bool(state.running or state.waiting)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
