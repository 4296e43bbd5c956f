"""Service errors cross Ray calls from a model's deployment (pickled there, unpickled in the ingress) as they are:
the same class, message, status and headers, whatever their class was built from."""

from __future__ import annotations

import pickle

import pytest

from service.errors import ContextLengthError, ModelQueueFullError, PromptError, QueueTimeoutError

ERRORS = [
    QueueTimeoutError("lm", 1.25, 0.5),
    ContextLengthError("lm", 3, 70, 64),
    ModelQueueFullError("lm"),
    PromptError("the prompt is empty"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_a_service_error_is_the_same_error_once_unpickled(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert again.status == error.status and again.headers() == error.headers()
