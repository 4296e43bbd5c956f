# syntax=docker/dockerfile:1
# mha-serving image: Ray Serve and ONNX Runtime serving exported models, as uid 1000; no torch, no sources.
# Every stage starts FROM an image named by a build argument (never a stage picked by name), so `docker build`
# (BuildKit or the legacy builder), `podman build` and `buildah bud` all build it and pull only the bases it uses:
#   CPU: docker build -t REGISTRY/mha-serving-cpu:0.1.0 .
#   GPU: docker build --build-arg ORT_PACKAGE="onnxruntime-gpu[cuda,cudnn]==1.31.1" -t REGISTRY/mha-serving-gpu:0.1.0 .
#   models: --build-arg MODELS=default bakes the five default head configurations into /home/ray/models (what
#     deploy/k8s expects); MODELS=none (the default) leaves the folder empty for a volume.
# deploy/image_check.sh builds, runs and checks it; tests/test_deploy_manifests.py lints it with hadolint.

ARG RAY_VERSION=2.60.0
# python:3.11-slim with ray[serve] installed (smaller than rayproject/ray: README, Container image); any base
# with Python 3.11 and pip works, rayproject/ray:${RAY_VERSION}-py311 included (its ray[serve] is then kept)
ARG BASE_IMAGE=python:3.11-slim
ARG EXPORT_IMAGE=python:3.11-slim

# ---- build: the project's wheel; with MODELS=default also torch (CPU wheel) and `mha-serving export` ----
FROM ${EXPORT_IMAGE} AS build
ARG MODELS=none
# PyTorch's CPU index: PyPI's wheel of the same version pulls several GB of CUDA libraries
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# every package pyproject.toml installs (tests/test_image_context.py checks these lines against it)
COPY pyproject.toml README.md ./
COPY contract/ contract/
COPY export/ export/
COPY service/ service/
COPY loadtest/ loadtest/
COPY optimize/ optimize/
# d_model 512, h in {1, 2, 4, 8, 16}: mha-h1-d512 ... mha-h16-d512, each written only after the parity gate
# hadolint ignore=DL3013
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && mkdir /models \
 && case "$MODELS" in \
      none) ;; \
      default) pip install --index-url "$TORCH_INDEX" "torch==2.13.0" \
        && pip install "$(ls /wheels/*.whl)[export]" && mha-serving export --out /models ;; \
      *) echo "MODELS is default or none, not $MODELS" >&2; exit 1 ;; \
    esac

# ---- runtime: the base as root for the install, then uid 1000 gid 100 (numeric, so Kubernetes' runAsNonRoot can
# check it; the `ray` user of rayproject/ray, created where the base has none) ----
FROM ${BASE_IMAGE} AS runtime
ARG RAY_VERSION
# GPU: onnxruntime-gpu[cuda,cudnn], the CUDA and cuDNN libraries it is built against as pip packages (so no CUDA
# base image is needed); service/runtime.py loads them (onnxruntime.preload_dlls) before it asks for CUDA.
ARG ORT_PACKAGE=onnxruntime==1.32.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Ray's object store at most 1 GB (it would take 30 % of memory): requests and answers are kilobytes, and it stays in
# /dev/shm when that has 2 GB (`--shm-size=2g`) instead of falling back to /tmp.
ENV RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES=1000000000
# On a cluster, Serve's proxy checks the default request limits before it reads a body (service/http/limits.py).
ENV RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=service.http.limits:proxy_middlewares
# On a cluster, Serve's HAProxy runs without kernel splicing (service/haproxy_nosplice.py): linked here below.
ENV RAY_SERVE_HAPROXY_BINARY_PATH=/usr/local/bin/mha-serving-haproxy
USER 0
COPY --from=build /wheels/ /tmp/wheels/
# The serving install (the wheel's dependencies: no torch, onnx or matplotlib) with one ONNX Runtime; wget for
# KubeRay's default liveness probe; ray[serve] pinned to the cluster's Ray.
# hadolint ignore=DL3008,DL3013,SC2046
RUN if ! command -v wget >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends wget && rm -rf /var/lib/apt/lists/*; fi \
 && if ! id -u 1000 >/dev/null 2>&1; then \
      useradd --uid 1000 --gid 100 --create-home --home-dir /home/ray --shell /bin/bash ray; fi \
 && python -m pip install $(ls /tmp/wheels/*.whl) "ray[serve]==${RAY_VERSION}" "${ORT_PACKAGE}" \
 && rm -rf /tmp/wheels \
 && if [ ! -e "$RAY_SERVE_HAPROXY_BINARY_PATH" ]; then \
      ln -s "$(command -v mha-serving-haproxy)" "$RAY_SERVE_HAPROXY_BINARY_PATH"; fi \
 && "$RAY_SERVE_HAPROXY_BINARY_PATH" -v \
 && python -m pip check \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
COPY --from=build --chown=1000:100 /models /home/ray/models
USER 1000:100
WORKDIR /home/ray
# SIGTERM drains (readiness 503 at once, requests in progress get limits.drain_s, 8 s) and stops Ray in about 2 s:
# idle it exits in 2-3 s; with requests in progress up to about 10 s, so run with --stop-timeout 15 (README).
STOPSIGNAL SIGTERM
# Serve HTTP, gRPC (the Open Inference Protocol and grpc.health.v1) and Ray's Prometheus metrics; KubeRay replaces
# the command with `ray start` and deploys serveConfigV2.
EXPOSE 8000 8001 8080
CMD ["mha-serving", "serve", "--models", "/home/ray/models", "--host", "0.0.0.0", "--port", "8000"]
