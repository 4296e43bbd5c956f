"""The `generate` block of the application's typed configuration: how each decoder's generation engine runs, at the
process boundary (pydantic), turned into the engine's frozen GenerationSettings. No torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GenerateConfig(BaseModel):
    """How each decoder's generation engine runs (service/generate/settings.py's GenerationSettings, whose comments
    give the reasons for the defaults), co-located in every serving process or in a deployment of its own."""

    model_config = ConfigDict(extra="forbid")
    kv_cache_mb: float = Field(
        128.0, gt=0, allow_inf_nan=False, description="the bytes each decoder's KV cache may hold (docs/serving.md)"
    )
    kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="the budget as rows x width of the batch instead (wins over kv_cache_mb); at least one context",
    )
    max_running: int = Field(32, ge=1, description="sequences in one decoding step (a step's batch size)")
    prefill_chunk: int = Field(256, ge=1, description="prompt tokens one step runs while others decode (chunks)")
    max_waiting: int = Field(256, ge=1, description="sequences queued for room in the budget; one more: 503")
    queue_timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="a queued sequence not started by then: 503 with Retry-After"
    )
    threads: int = Field(2, ge=1, description="ORT intra-op threads of each decoder")
    spinning: Literal["off", "run", "always"] = Field("run", description="ORT's waiting threads (as ort_spinning)")

    def settings(self, backend: str):
        """The engine's GenerationSettings (imported here: the engine's modules load ONNX Runtime)."""
        from service.generate.settings import GenerationSettings

        return GenerationSettings(**self.model_dump(), backend=backend)
