"""How a process waits for its GPU (service/cuda_wait.py): an unknown wait is refused, a machine without the CUDA
driver keeps CUDA's default and says why, and on a GPU `block` is really set on the context ORT's session uses."""

from __future__ import annotations

import ctypes

import pytest

from service import cuda_wait
from service.runtime import load_runtime


def _driver_present() -> bool:
    try:
        ctypes.CDLL(cuda_wait.DRIVER)
    except OSError:
        return False
    return True


def test_an_unknown_wait_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="auto, spin, yield, block"):
        cuda_wait.set_gpu_wait("busy")


@pytest.mark.skipif(_driver_present(), reason="this machine has the CUDA driver")
def test_without_the_cuda_driver_the_default_stays_and_the_status_says_why(monkeypatch):
    monkeypatch.setattr(cuda_wait, "_set", None)
    said = cuda_wait.set_gpu_wait("block")
    assert said.startswith("GPU wait auto: block could not be set") and "libcuda" in said
    assert cuda_wait._set is None  # nothing was set: a later model may try again


def test_the_first_wait_set_in_a_process_stands_and_a_different_one_is_told_so(monkeypatch):
    monkeypatch.setattr(cuda_wait, "_set", "block")
    assert cuda_wait.set_gpu_wait("block") == "GPU wait block"
    said = cuda_wait.set_gpu_wait("spin")
    assert said == "GPU wait block (set by the first GPU model in this process; spin was asked for)"


@pytest.mark.gpu
def test_block_is_set_on_the_context_that_ort_opens(tiny_models_dir, monkeypatch):
    monkeypatch.setattr(cuda_wait, "_set", None)
    rt = load_runtime(tiny_models_dir, "mha-h2-d32", "gpu", threads=1, gpu_wait="block")
    assert rt.reason.endswith("GPU wait block"), rt.reason
    assert cuda_wait.primary_context_wait() == ("block", True)
