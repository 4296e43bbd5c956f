#!/usr/bin/env bash
# Token generation on a GPU machine, in one sitting: the engine's tokens/s with the KV cache bound to the device
# (ORT I/O binding, the GPU default) against the plain host round trip, fp32 and fp16, at 1, 8 and 32 sequences;
# then the same on the CPU for scale; then the tests marked `gpu` (the bound engine's greedy tokens against the CPU's,
# the fp16 decoder's gate).
#   usage (repository root): benchmarks/generation_gpu.sh MODELS OUT
#   MODELS gets lm-h8-kv2-d512 (context 512) exported if missing (`mha-serving export --decoder` needs torch) and its
#   fp16 variant made here (its GPU gate included). Run with the serving stack importable (PYTHONPATH, or the gpu
#   extra); output goes to OUT; ENGINE_S (240) bounds each engine run.
set -u
models=${1:?usage: generation_gpu.sh MODELS OUT}; out=${2:?usage: generation_gpu.sh MODELS OUT}
mkdir -p "$out" "$models"
export PYTHONUNBUFFERED=1
model=lm-h8-kv2-d512
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
} 2>&1 | tee "$out/machine.txt"
[ -f "$models/$model/model.onnx" ] || python3 -m service.cli export --decoder --heads 8 --kv-heads 2 --d-model 512 \
  --layers 4 --max-len 512 --out "$models"
[ -f "$models/$model-fp16/model.onnx" ] || python3 -m service.cli quantize --model "$models/$model" --precision fp16

engine() {  # NAME ARGS...: one engine run, its table in OUT/NAME.log and figures in OUT/NAME.json
  local name=$1; shift
  timeout "${ENGINE_S:-240}" python3 -m benchmarks.generation_engine --models "$models" --json "$out/$name.json" "$@" \
    > "$out/$name.log" 2>&1
  echo "$name: exit status $?"; cat "$out/$name.log"
}
engine gpu-fp32 --model "$model" --backend gpu --concurrency 1,8,32 --max-tokens 256 --rounds 3
engine gpu-fp16 --model "$model-fp16" --backend gpu --concurrency 1,8,32 --max-tokens 256 --rounds 3
engine cpu-fp32 --model "$model" --backend cpu --concurrency 1,8 --max-tokens 64 --rounds 2 --threads 16
python3 -m pytest -q -m gpu -p no:randomly tests/test_generation_io_binding.py tests/test_decoder_quantize.py 2>&1 \
  | tail -5 | tee "$out/gpu-tests.log"
