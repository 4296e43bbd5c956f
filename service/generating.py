"""A decoder's placement: its generation engine (service/generate/) in this serving process, as every serving
process holds one. It answers `status` like a classifier's placement; classification asked of it is a 400 naming
the generation routes. No torch.
"""

from __future__ import annotations

import numpy as np

from service.errors import BadRequestError
from service.generate import GenerateRequest, GenerationEngine, TokenStream
from service.inference import ModelStatus

GENERATION_ROUTES = "/openai/v1/completions or /v2/models/{name}/generate"


def not_a_classifier(name: str) -> BadRequestError:
    return BadRequestError(f"model {name!r} is a decoder: use {GENERATION_ROUTES.replace('{name}', name)}")


class ColocatedDecoder:
    """The decoder's engine lives in the ingress replica; `generate` submits to it."""

    placement = "colocated"
    generates = True

    def __init__(self, engine: GenerationEngine) -> None:
        self.name = engine.name
        self.engine = engine
        meta, runtime = engine.meta, engine.runtime
        self._status = ModelStatus(self.name, True, runtime.reason, runtime.backend, runtime.threads, meta)

    async def status(self) -> ModelStatus:
        return self._status

    def submit(self, request: GenerateRequest) -> TokenStream:
        return self.engine.submit(request)

    async def infer(self, ids: np.ndarray, mask: np.ndarray, alone: bool = False):
        raise not_a_classifier(self.name)

    async def spare_infer(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        raise not_a_classifier(self.name)

    def preempt(self) -> None:
        """Nothing to stop: a decoder is never a shadow."""

    async def attention(self, ids: np.ndarray):
        raise not_a_classifier(self.name)

    async def drain(self, grace_s: float) -> None:
        await self.engine.drain(max(0.0, grace_s))

    def busy(self) -> bool:
        state = self.engine.state()
        return bool(state.running or state.waiting)

    def close(self) -> None:
        self.engine.close()
