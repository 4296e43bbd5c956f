"""The ingress's shadow worker (service/shadow.py) with a model in its own deployment (service/placement.py's
`Remote`): a mirrored call that Ray never answers is a failed mirror after SPARE_TIMEOUT_S, and the worker goes on
to the next. The deployment's handle is a stand-in: the worker and the placement, not Serve, are what is checked."""

from __future__ import annotations

import asyncio

import numpy as np

from service import placement
from service.placement import Remote
from service.shadow import COMPARED, FAILED, Mirror, ShadowTraffic


class FirstCallHangs:
    """A model deployment's handle as `Remote.spare_infer` uses it: its first call never answers, later ones answer
    with logits equal to the mirror's answer."""

    def __init__(self) -> None:
        self.calls = 0
        self.spare_infer = self

    def remote(self, ids: np.ndarray, mask: np.ndarray):
        self.calls += 1
        return self._answer(ids, hang=self.calls == 1)

    async def _answer(self, ids: np.ndarray, hang: bool) -> np.ndarray:
        if hang:
            await asyncio.Event().wait()
        return np.zeros((ids.shape[0], 2), np.float32)  # (n, C)


def _mirror(token: int) -> Mirror:
    ids = np.array([[token]], dtype=np.int64)  # (1, 1)
    return Mirror("r", "primary", "shadow", ids, np.ones_like(ids), np.zeros((1, 2), np.float32))


def test_a_mirrored_call_never_answered_is_a_failed_mirror_and_the_next_mirror_runs(monkeypatch):
    monkeypatch.setattr(placement, "SPARE_TIMEOUT_S", 0.2)

    async def scenario() -> list[tuple[int, str]]:
        remote = Remote("shadow", FirstCallHangs(), None)
        outcomes: list[tuple[int, str]] = []
        done = asyncio.Event()

        def record(mirror: Mirror, outcome: str, _agreement) -> None:
            outcomes.append((int(mirror.ids[0, 0]), outcome))
            if len(outcomes) == 2:
                done.set()

        shadows = ShadowTraffic(lambda m: remote.spare_infer(m.ids, m.mask), lambda _: None, lambda: False, record)
        shadows.offer(_mirror(1))
        shadows.offer(_mirror(2))
        await asyncio.wait_for(done.wait(), 5)
        return outcomes

    assert asyncio.run(scenario()) == [(1, FAILED), (2, COMPARED)]
