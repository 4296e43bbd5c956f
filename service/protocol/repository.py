"""The model repository API's bodies (the Open Inference Protocol's repository extension, as Triton's clients send
them): what index, load and unload take and answer, checked here at the boundary so that any other shape is a 400
naming the field. The route bodies are the config's `Route` (service/config.py). No torch.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

from service.inference import MODEL_VERSION

# A repository parameter's value, as the protocol's `$parameters` allow: a string, a number or a boolean.
Parameter = StrictBool | StrictInt | StrictFloat | StrictStr
UNSUPPORTED_LOAD = ("config", "file:")  # Triton's overrides: a model is loaded from its folder as exported
NO_OVERRIDES = {  # UNSUPPORTED_LOAD as JSON Schema: the document says what a load takes
    "propertyNames": {"not": {"anyOf": [{"const": UNSUPPORTED_LOAD[0]}, {"pattern": f"^{UNSUPPORTED_LOAD[1]}"}]}}
}


class RepositoryIndexRequest(BaseModel):
    """The index's body, optional: `ready` lists the served models only."""

    ready: StrictBool = False


class RepositoryLoadRequest(BaseModel):
    """A load's body, optional. Triton's `config` and `file:` overrides are refused: a model loads from its folder
    as exported; other parameters are taken and ignored."""

    parameters: Annotated[dict[str, Parameter], Field(json_schema_extra=NO_OVERRIDES)] | None = None

    @field_validator("parameters")
    @classmethod
    def _no_overrides(cls, parameters: dict[str, Parameter] | None) -> dict[str, Parameter] | None:
        overrides = [k for k in parameters or {} if k == UNSUPPORTED_LOAD[0] or k.startswith(UNSUPPORTED_LOAD[1])]
        if overrides:
            raise ValueError(f"{overrides} are not supported: a model is loaded from its folder as exported")
        return parameters


class RepositoryUnloadRequest(BaseModel):
    """An unload's body, optional; its parameters (Triton's `unload_dependents`) are taken and ignored."""

    parameters: dict[str, Parameter] | None = None


class RepositoryModel(BaseModel):
    """One model of the repository index: READY (served) or UNAVAILABLE (unloaded, or why it cannot serve)."""

    name: str
    version: str = MODEL_VERSION
    state: str
    reason: str = ""


class RepositoryIndex(RootModel[list[RepositoryModel]]):
    """Every model folder and served model, with its state."""


class RepositoryChanged(BaseModel):
    """The change is made in every serving process (an empty object)."""

    model_config = ConfigDict(extra="forbid")


REQUEST_BODIES = (RepositoryIndexRequest, RepositoryLoadRequest, RepositoryUnloadRequest)
