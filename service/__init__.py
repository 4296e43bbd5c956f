"""Serving side of mha-serving: ONNX Runtime sessions in Ray Serve behind an HTTP API. Must not import torch."""
