"""`python -m benchmarks.scale`: one model served by 1, 2, 4, ... serving processes on one node (`mha-serving serve
--processes N`), each level driven by load-client processes of its own, against bare ONNX Runtime in the same run."""
