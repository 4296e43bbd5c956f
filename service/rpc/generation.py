"""The generation RPC's messages (contract/rpc/generation.proto): a ModelGenerateRequest decoded into the same
GenerateRequest as HTTP's generate (through its GenerateBody, so a bad value gets the same 400 text), and each token
event encoded as a ModelGenerateResponse, as the HTTP generate_stream encodes it. No torch.
"""

from __future__ import annotations

import dataclasses

from contract.rpc import generation_pb2 as pb
from service.errors import BadRequestError
from service.generate import GenerateRequest, TokenEvent
from service.protocol import generate as oip
from service.protocol.parsing import validated

OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")  # unset: GenerateParameters' defaults


def to_body(message: pb.ModelGenerateRequest) -> oip.GenerateBody:
    """The message as HTTP's generate body; 400 naming what pydantic refused."""
    params = message.parameters
    given = {name: getattr(params, name) for name in OPTIONAL if params.HasField(name)}
    if params.stop:
        given["stop"] = list(params.stop)
    parameters = {**given, "ignore_eos": params.ignore_eos}
    values = {"text_input": message.text_input, "parameters": parameters, "id": message.id or None}
    return validated(values, oip.GenerateBody)


def to_request(
    message: pb.ModelGenerateRequest, body: oip.GenerateBody, arrived: float | None = None
) -> GenerateRequest:
    """The body's request, with the message's token ids as the prompt where it gives them instead of text; timed from
    `arrived` (a perf_counter())."""
    request = dataclasses.replace(oip.to_request(body), arrived=arrived)
    if not message.prompt_token_ids:
        return request
    if message.text_input:
        raise BadRequestError("give the prompt as text_input or as prompt_token_ids, not both")
    return dataclasses.replace(request, prompt=tuple(message.prompt_token_ids))


def to_response(name: str, body: oip.GenerateBody, event: TokenEvent) -> pb.ModelGenerateResponse:
    """One event's message: its text delta and tokens; `details` (finish reason, token counts) on the last."""
    return pb.ModelGenerateResponse(**oip.answer(name, body, event.text, event), token_ids=event.token_ids)
