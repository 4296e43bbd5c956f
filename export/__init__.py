"""Model side of mha-serving: the multi-head attention layer, models, training and ONNX export.

Only this package may import torch, and only in its modules that need it (metadata and tokenizer stay torch-free).
"""
