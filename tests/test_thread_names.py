"""A serving process's threads named for the OS (service/thread_names.py): what `top -H` shows and the scaling
benchmark reads to split a process's CPU by kind of thread."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from benchmarks.harness.processes import thread_names
from service.batching import BatchPolicy
from service.engine import EngineSettings, ModelEngine
from service.thread_names import ENGINE, RUNS, current_name, name_thread, threads_named

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are set on Linux only")


def in_a_thread(fn):
    """fn() run on a fresh thread (the main thread is never renamed); its result, or its exception raised here."""
    got: dict = {}

    def body() -> None:
        try:
            got["value"] = fn()
        except BaseException as exc:  # handed to the caller
            got["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(60)
    if "error" in got:
        raise got["error"]
    return got["value"]


def test_a_thread_names_itself_in_at_most_15_bytes():
    def named() -> tuple[bool, str, str]:
        ok = name_thread("a-name-longer-than-fifteen")
        return ok, current_name(), thread_names(os.getpid())[threading.get_native_id()]

    assert in_a_thread(named) == (True, "a-name-longer-t", "a-name-longer-t")


def test_the_main_thread_keeps_the_process_name():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("pytest runs this test off the main thread")
    before = Path("/proc/self/comm").read_text()
    assert name_thread("renamed") is False
    assert Path("/proc/self/comm").read_text() == before


def test_threads_started_within_the_block_take_its_name_and_the_creator_gets_its_own_back():
    def started_within() -> tuple[str, str, str]:
        name_thread("creator")
        seen: dict[str, str] = {}
        with threads_named("engine:x"):
            child = threading.Thread(target=lambda: seen.update(child=current_name()))
            child.start()
            child.join(10)
            inside = current_name()
        return inside, seen["child"], current_name()

    assert in_a_thread(started_within) == ("engine:x", "engine:x", "creator")


def test_an_engines_run_threads_and_orts_own_threads_are_named_after_its_model(tiny_models_dir):
    # Two intra-op threads with no light-model rule: ORT starts a pool thread of its own for the session.
    settings = EngineSettings("cpu", 2, BatchPolicy(), light_threads=None, runs=1)

    def opened() -> tuple[dict[int, str], str]:
        name_thread("loader")
        before = set(thread_names(os.getpid()))
        engine = ModelEngine(str(tiny_models_dir), "mha-h2-d32", settings)
        assert engine.status().ready, engine.status()
        new = {tid: name for tid, name in thread_names(os.getpid()).items() if tid not in before}
        return new, current_name()

    new, after = in_a_thread(opened)
    names = sorted(new.values())
    assert after == "loader"
    assert names.count(f"{RUNS}mha-h2-d32") == 2, names  # max_runs + 1 for attention
    assert f"{ENGINE}mha-h2-d32" in names, names  # ORT's intra-op thread
    assert set(names) <= {f"{RUNS}mha-h2-d32", f"{ENGINE}mha-h2-d32"}, names
