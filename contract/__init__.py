"""The model contract, torch-free: ONNX metadata, the tokenizer, export settings and attention-map reading. Both
`export/` (which writes models) and `service/` (which serves them) import it; it imports neither."""
