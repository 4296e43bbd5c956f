"""The model engine's thread pool (service/engine.py started_pool): every thread started at once, so a replica's
thread count does not creep up over hours as a lazily grown pool's does."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from service.engine import started_pool


def threads_named(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_every_thread_of_the_pool_is_running_once_it_is_made():
    pool = started_pool(3, "started-pool-test")
    try:
        assert threads_named("started-pool-test") == 3
        assert pool.submit(lambda: 41 + 1).result(timeout=10) == 42
        assert threads_named("started-pool-test") == 3
    finally:
        pool.shutdown()


def test_a_lazy_pool_would_have_started_fewer():  # what started_pool is for: the standard pool starts on demand
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="lazy-pool-test")
    try:
        pool.submit(lambda: None).result(timeout=10)
        assert threads_named("lazy-pool-test") == 1
    finally:
        pool.shutdown()
