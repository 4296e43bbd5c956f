"""`python -m benchmarks.generate`: token generation served against a bare batched loop, ONNX Runtime GenAI and a
plain FastAPI + ORT streaming server, on one decoder, in alternating rounds (issue 59 item 2)."""
