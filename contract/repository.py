"""The model repository API's contract between the service and its clients (`mha-serving optimize --rollout`):
where the token comes from and which header carries it by default. Torch-free.
"""

from __future__ import annotations

TOKEN_ENV = "MHA_REPOSITORY_TOKEN"  # the token: an environment variable, never a flag (ps shows flags)
DEFAULT_HEADER = "x-mha-repository-token"
