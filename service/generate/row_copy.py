"""Copying one row of a KV buffer to another on the device that holds it, through ONNX Runtime (its Python API has no
device-to-device copy): a one-node graph, `y = Identity(x)`, whose input and output are bound to the two rows'
addresses. The graphs are written here as their serialized bytes (the service does not depend on `onnx`; a test
rebuilds them with it and compares). No torch."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

# ModelProto: ir_version 8, opset 13, graph "row_copy": Identity(x) -> y, x and y of shape ["n"] and the element type
# (1: float, 10: float16). tests/test_slot_cache.py rebuilds them with onnx.helper.
_GRAPHS = {
    np.dtype(np.float32): b'\x08\x08\x12\x00:@\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x08row_copyZ\x10\n\x01x\x12\x0b'
    b"\n\t\x08\x01\x12\x05\n\x03\x12\x01nb\x10\n\x01y\x12\x0b\n\t\x08\x01\x12\x05\n\x03\x12\x01nB\x04\n\x00\x10\r",
    np.dtype(np.float16): b'\x08\x08\x12\x00:@\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x08row_copyZ\x10\n\x01x\x12\x0b'
    b"\n\t\x08\n\x12\x05\n\x03\x12\x01nb\x10\n\x01y\x12\x0b\n\t\x08\n\x12\x05\n\x03\x12\x01nB\x04\n\x00\x10\r",
}


class RowCopy:
    """`copy(source, target, count)`: `count` elements from address `source` to address `target` on `device`."""

    def __init__(self, dtype: np.dtype, device: str, providers: list) -> None:
        self._dtype, self._device = np.dtype(dtype), device
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self._session = ort.InferenceSession(_GRAPHS[self._dtype], options, providers=providers)

    def copy(self, source: int, target: int, count: int) -> None:
        binding = self._session.io_binding()
        binding.bind_input("x", self._device, 0, self._dtype, [count], source)
        binding.bind_output("y", self._device, 0, self._dtype, [count], target)
        self._session.run_with_iobinding(binding)
