"""What is in progress in one serving process, counted by the service itself: requests a transport has begun (from
their head, before any handler runs) and inference requests the data plane admitted. Batching reads it to run a
lone request inline, shadow traffic to find spare capacity. No torch.
"""

from __future__ import annotations


class Load:
    def __init__(self) -> None:
        self.arrived = 0  # requests begun and not answered, counted by transports that see heads arrive
        self.inference = 0  # inference requests admitted and not answered (the data plane's in-flight)
        self.counting = False  # a transport counts `arrived`; without one, nothing is known of requests queued

    def alone(self) -> bool:
        """Whether the one inference request asking is all that is in progress here, including requests whose head
        was read and whose handler has not run yet."""
        return self.counting and self.inference <= 1 and self.arrived <= 1

    def busy(self) -> bool:
        """Whether a client's request is in progress here (including one whose head was read, not yet handled)."""
        return self.inference > 0 or self.arrived > 0
