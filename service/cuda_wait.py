"""How this process's threads wait for the GPU: the scheduling flag of the device's primary CUDA context, which ORT's
CUDA provider uses. CUDA's default (`auto`) spins a thread on a core for as long as the GPU works whenever a process
has fewer contexts than the machine has cores, so N serving processes sharing one GPU keep N cores busy waiting.
`block` makes the waiting thread sleep until the GPU is done.

ORT has no option for this; the CUDA driver's documented `cuDevicePrimaryCtxSetFlags` sets it for the process,
before the first CUDA session opens (ctypes on libcuda, no build step). One setting per process: the first GPU model
opened decides, a later one that asks for another is told so. No torch.
"""

from __future__ import annotations

import ctypes
import threading

WAITS = ("auto", "spin", "yield", "block")
_FLAGS = {"auto": 0x0, "spin": 0x1, "yield": 0x2, "block": 0x4}  # CU_CTX_SCHED_AUTO, _SPIN, _YIELD, _BLOCKING_SYNC
_SCHED_MASK = 0x7
DRIVER = "libcuda.so.1"

_lock = threading.Lock()
_set: str | None = None  # what this process set; None: not yet


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL(DRIVER)
    for name in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxGetState"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _checked(rc: int, call: str) -> None:
    if rc != 0:
        raise OSError(f"{call} returned CUDA error {rc}")


def _device(lib: ctypes.CDLL, ordinal: int) -> ctypes.c_int:
    dev = ctypes.c_int()
    _checked(lib.cuInit(0), "cuInit")
    _checked(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    return dev


def _set_flags(lib: ctypes.CDLL, device: int, flags: int) -> None:
    dev = _device(lib, device)
    # cuda.h maps cuDevicePrimaryCtxSetFlags to its _v2 (CUDA >= 11), which may be called while the context is active.
    set_flags = getattr(lib, "cuDevicePrimaryCtxSetFlags_v2", None) or lib.cuDevicePrimaryCtxSetFlags
    set_flags.restype = ctypes.c_int
    _checked(set_flags(dev, ctypes.c_uint(flags)), "cuDevicePrimaryCtxSetFlags")


def set_gpu_wait(wait: str, device: int = 0) -> str:
    """Set how this process waits for GPU `device` (an ordinal among the visible ones), once; what was done, in words
    for the model's status. `auto` leaves CUDA's default. ValueError for an unknown wait."""
    global _set
    if wait not in WAITS:
        raise ValueError(f"gpu_wait must be one of {', '.join(WAITS)}, got {wait!r}")
    with _lock:
        if _set is not None:
            if _set != wait:
                return f"GPU wait {_set} (set by the first GPU model in this process; {wait} was asked for)"
            return f"GPU wait {wait}"
        if wait == "auto":
            _set = wait
            return "GPU wait auto (CUDA's default)"
        try:
            _set_flags(_driver(), device, _FLAGS[wait])
        except (OSError, AttributeError) as exc:  # no driver library, or a call it refused: CUDA's default stays
            return f"GPU wait auto: {wait} could not be set ({exc})"
        _set = wait
        return f"GPU wait {wait}"


def primary_context_wait(device: int = 0) -> tuple[str, bool]:
    """The wait set on GPU `device`'s primary context, and whether that context is active (someone opened it)."""
    lib = _driver()
    dev, flags, active = _device(lib, device), ctypes.c_uint(), ctypes.c_int()
    state = lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
    _checked(state, "cuDevicePrimaryCtxGetState")
    names = {v: k for k, v in _FLAGS.items()}
    return names.get(flags.value & _SCHED_MASK, hex(flags.value)), bool(active.value)
