#!/usr/bin/env bash
# The whole node's figures on a GPU machine, in one sitting: ORT's run modes, then `python -m benchmarks.scale` on
# the GPU (fp32 and fp16, 8 and 12 processes, the defaults and a variant in the same rounds) and on the CPU (the
# small model, 1 and 8 processes).
#   usage (repository root): benchmarks/scale/gpu_node.sh MODELS OUT
#   MODELS holds mha-h8-d512 and mha-h4-d128 (exported elsewhere: `mha-serving export` needs torch); the fp16 variant
#   is made here, its GPU gate included. Run with the serving stack importable (PYTHONPATH, or the gpu extra).
#   GPU_PROCESSES (8,12), GPU_VARIANT (block:gpu_wait=block,inline_on_gpu=true; empty: none), MPS=1 (NVIDIA's MPS
#   daemon running during the GPU run), GPU_S (330) and CPU_S (150) bound the two scaling runs; output goes to OUT.
#   For a machine of its own: after each scaling run it kills every `service.cli serve` and Ray process there.
set -u
models=${1:?usage: gpu_node.sh MODELS OUT}; out=${2:?usage: gpu_node.sh MODELS OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

stop_servers() {  # a scaling run cut by its timeout leaves its servers (each in a session of its own) and their Rays
  pkill -TERM -f "service.cli serve"; sleep 3
  pkill -9 -f "service.cli serve"; pkill -9 -f raylet; pkill -9 -f gcs_server; pkill -9 -f "ray::"; sleep 1
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g
  python3 -c "import onnxruntime as o, ray; print('onnxruntime', o.__version__, o.get_available_providers(), 'ray', ray.__version__)"
} 2>&1 | tee "$out/machine.txt"
[ -f "$models/mha-h8-d512-fp16/model.onnx" ] || python3 -m service.cli quantize --model "$models/mha-h8-d512" --precision fp16

python3 -m benchmarks.run_modes --models "$models" --model mha-h8-d512 --model mha-h8-d512-fp16 \
  --batches 1,8,32,64,256 --seconds 1 --rounds 2 --json "$out/run_modes.json" 2>&1 | tee "$out/run_modes.log"

variant=${GPU_VARIANT-block:gpu_wait=block,inline_on_gpu=true}
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps /tmp/mps-log && nvidia-cuda-mps-control -d && echo "MPS daemon started"
fi
timeout "${GPU_S:-330}" python3 -m benchmarks.scale --backend gpu --models "$models" --model default \
  --precision fp32,fp16 --processes "${GPU_PROCESSES:-8,12}" ${variant:+--variant "$variant"} --clients 4 \
  --concurrency 64 --body binary --seconds 4 --rounds 2 --json "$out/scale_gpu.json" --plot "$out/scale_gpu.png" \
  > "$out/scale_gpu.log" 2>&1
echo "GPU scaling: exit status $?"; stop_servers; tail -c 5000 "$out/scale_gpu.log"
if [ "${MPS:-0}" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi

timeout "${CPU_S:-150}" python3 -m benchmarks.scale --backend cpu --models "$models" --model small \
  --processes 1,8 --clients 4 --concurrency 32 --body binary --seconds 4 --rounds 2 \
  --json "$out/scale_cpu.json" > "$out/scale_cpu.log" 2>&1
echo "CPU scaling: exit status $?"; stop_servers; tail -c 3000 "$out/scale_cpu.log"
