"""Token generation for decoder models: a per-model engine with iteration-level batching (scheduler, step runner,
output processing), transport-free; the data plane and the transports build on `GenerationEngine`. No torch."""

from service.generate.engine import GenerationEngine
from service.generate.output import ABORT, CANCELLED, EOS, FINISH_REASONS, LENGTH, OPENAI_FINISH_REASONS, STOP
from service.generate.request import GenerateRequest, Timing, TokenEvent, Usage
from service.generate.sampling import SamplingParams
from service.generate.scheduler import SchedulerState
from service.generate.session import DecoderRuntime, load_decoder
from service.generate.settings import GenerationSettings
from service.generate.stream import TokenStream

__all__ = [
    "ABORT",
    "CANCELLED",
    "EOS",
    "FINISH_REASONS",
    "LENGTH",
    "OPENAI_FINISH_REASONS",
    "STOP",
    "DecoderRuntime",
    "GenerateRequest",
    "GenerationEngine",
    "GenerationSettings",
    "SamplingParams",
    "SchedulerState",
    "Timing",
    "TokenEvent",
    "TokenStream",
    "Usage",
    "load_decoder",
]
