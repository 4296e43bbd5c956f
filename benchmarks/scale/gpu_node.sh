#!/usr/bin/env bash
# The whole node's figures on a GPU machine, in one sitting of `python -m benchmarks.scale` (h8 d512):
#   1. the rate: fp32 and fp16 served by GPU_PROCESSES (8,12) processes, CUDA's default wait against `gpu_wait:
#      block`, in the same rounds: requests/s, fp16 / fp32, GPU busy, the CPU per request by thread (and by stage
#      of the request path where py-spy is there to run);
#   2. one request at a time: fp16 by 8 processes, the defaults against `inline_on_gpu` and against both levers,
#      in the same rounds: c=1 p50 over bare ORT (each lever apart: `block` may cost a wake-up that inline saves);
#   then, when asked: RUN_MODES=1 ORT's run modes (plain, I/O binding, CUDA graphs); CPU=1 the CPU backend (the
#   small model, 1 and 8 processes). Both were measured on 2026-12-04 (docs/benchmarks-history.md).
#   usage (repository root): benchmarks/scale/gpu_node.sh MODELS OUT
#   MODELS holds mha-h8-d512 (and mha-h4-d128 for CPU=1), exported elsewhere (`mha-serving export` needs torch); the
#   fp16 variant is made here, its GPU gate included. Run with the serving stack importable (PYTHONPATH, or the gpu
#   extra). MPS=1 runs NVIDIA's MPS daemon during 1 and 2; GPU_S (330), C1_S (150) and CPU_S (150) bound the runs;
#   output goes to OUT. For a machine of its own: after each run it kills every `service.cli serve` and Ray process.
set -u
models=${1:?usage: gpu_node.sh MODELS OUT}; out=${2:?usage: gpu_node.sh MODELS OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

stop_servers() {  # a run cut by its timeout leaves its servers (each in a session of its own) and their Rays
  pkill -TERM -f "service.cli serve"; sleep 3
  pkill -9 -f "service.cli serve"; pkill -9 -f raylet; pkill -9 -f gcs_server; pkill -9 -f "ray::"; sleep 1
}

scale() {  # NAME LIMIT_S ARGS...: one scaling run, its report in OUT/NAME.log and OUT/NAME.json
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m benchmarks.scale --models "$models" --clients 4 --body binary --rounds 2 \
    --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit status $?"; stop_servers; tail -c 5000 "$out/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g
  python3 -c "import onnxruntime as o, ray; print('onnxruntime', o.__version__, o.get_available_providers(), 'ray', ray.__version__)"
} 2>&1 | tee "$out/machine.txt"
[ -f "$models/mha-h8-d512-fp16/model.onnx" ] || python3 -m service.cli quantize --model "$models/mha-h8-d512" --precision fp16

if [ "${RUN_MODES:-0}" = 1 ]; then
  python3 -m benchmarks.run_modes --models "$models" --model mha-h8-d512 --model mha-h8-d512-fp16 \
    --batches 1,8,32,64,256 --seconds 1 --rounds 2 --json "$out/run_modes.json" 2>&1 | tee "$out/run_modes.log"
fi

if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps /tmp/mps-log && nvidia-cuda-mps-control -d && echo "MPS daemon started"
fi
profile=""; command -v py-spy > /dev/null && profile=--profile
scale scale_gpu "${GPU_S:-330}" --backend gpu --model default --precision fp32,fp16 \
  --processes "${GPU_PROCESSES:-8,12}" --variant block:gpu_wait=block --concurrency 64 --seconds 4 $profile \
  --plot "$out/scale_gpu.png"
scale scale_gpu_c1 "${C1_S:-150}" --backend gpu --model default --precision fp16 --processes 8 \
  --variant inline:inline_on_gpu=true --variant both:gpu_wait=block,inline_on_gpu=true --concurrency 64 --seconds 3
if [ "${MPS:-0}" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi

if [ "${CPU:-0}" = 1 ]; then
  scale scale_cpu "${CPU_S:-150}" --backend cpu --model small --processes 1,8 --concurrency 32 --seconds 4
fi
