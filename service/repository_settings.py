"""The model repository API's settings (`repository` in the config; the API itself: service/repository.py). Imports
no Ray: the config is read before Ray's environment is set. No torch.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contract.repository import DEFAULT_HEADER


class RepositorySettings(BaseModel):
    """The model repository API (load, unload, index: service/repository.py), an administrative API: off unless
    enabled, and then answered only for a request that carries the token in `header`."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(False, description="serve /v2/repository/...; off: those paths answer 404")
    header: str = Field(DEFAULT_HEADER, min_length=1, description="the request header that must carry the token")
    token_sha256: str | None = Field(
        None,
        description="the token's SHA-256 (hex), so that no config shows the token itself (`mha-serving serve "
        "--repository` sets it from $MHA_REPOSITORY_TOKEN)",
    )

    @field_validator("header")
    @classmethod
    def _lowercase(cls, value: str) -> str:
        return value.lower()  # HTTP header names are case-insensitive; ASGI gives them in lower case

    @model_validator(mode="after")
    def _token_when_enabled(self) -> RepositorySettings:
        digest = self.token_sha256
        if digest is not None and not re.fullmatch(r"[0-9a-f]{64}", digest.lower()):
            raise ValueError("repository.token_sha256 must be 64 hexadecimal digits (a SHA-256)")
        if self.enabled and digest is None:
            raise ValueError("repository.enabled needs repository.token_sha256: an administrative API needs a token")
        return self
