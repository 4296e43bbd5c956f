# syntax=docker/dockerfile:1
# mha-serving images: models are exported with torch in a throwaway stage; the runtime image serves them without torch.
#   CPU: docker build -t REGISTRY/mha-serving-cpu:0.1.0 .
#   GPU: docker build --build-arg VARIANT=gpu -t REGISTRY/mha-serving-gpu:0.1.0 .
# (the image names deploy/k8s/base/kustomization.yaml expects)
# Not built in CI (no Docker engine there); tests/test_deploy_manifests.py lints this file with hadolint.

ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
# cpu: rayproject/ray:<RAY_VERSION>-<PYTHON_TAG> with onnxruntime; gpu: the -gpu (CUDA) image with onnxruntime-gpu
ARG VARIANT=cpu

# ---- export: torch (CPU wheel), then `mha-serving export` for the default head configurations ----
FROM python:3.11-slim AS export
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# torch from PyTorch's CPU index first: the PyPI wheel of the same version pulls several GB of CUDA libraries
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY export/ export/
COPY service/ service/
COPY loadtest/ loadtest/
# The project's own version ranges (pyproject.toml) govern here; torch is the pinned one, installed above.
# d_model 512, h in {1, 2, 4, 8, 16}: mha-h1-d512 ... mha-h16-d512, each written only after the parity gate
# hadolint ignore=DL3013
RUN pip install ".[export]" && mha-serving export --out /models

# ---- runtime bases: one per VARIANT, chosen below ----
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG} AS runtime-cpu
ENV ORT_PACKAGE="onnxruntime==1.32.0"

FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu AS runtime-gpu
# [cuda,cudnn]: the CUDA 12 / cuDNN 9 libraries onnxruntime-gpu is built against, as pip packages, whatever the base
# image ships; service/runtime.py loads them (onnxruntime.preload_dlls) before it asks for the CUDA provider.
ENV ORT_PACKAGE="onnxruntime-gpu[cuda,cudnn]==1.31.1"

# ---- runtime: the Ray image as its non-root `ray` user (uid 1000, gid 100: numeric, so Kubernetes'
# runAsNonRoot can check it), the service package, the exported models; no torch ----
# (DL3006: `runtime-${VARIANT}` names one of the two stages above, both tagged)
# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS runtime
ARG RAY_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# Serve's proxy (every node on a cluster) runs service/http_server.py's callback: the default request-head limits
# (431) and a 413 for `Expect: 100-continue` over the body limit, before it answers `100 Continue`.
ENV RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=service.http_server:proxy_callback
USER 1000:100
WORKDIR /home/ray/app
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 export/ export/
COPY --chown=1000:100 service/ service/
COPY --chown=1000:100 loadtest/ loadtest/
# Only what serving imports: the project without its dependency list (which names matplotlib and the export
# extra's neighbours), then the serving dependencies; ray[serve] is pinned to the base image's Ray.
# hadolint ignore=DL3013
RUN pip install --no-deps . \
 && pip install "ray[serve]==${RAY_VERSION}" "${ORT_PACKAGE}" "numpy>=1.26" "pydantic>=2.6" "fastapi>=0.110" \
      "pyyaml>=6" "httpx>=0.27" \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
COPY --from=export --chown=1000:100 /models /home/ray/models
# Serve HTTP and Ray's Prometheus metrics; KubeRay replaces the command with `ray start` and deploys serveConfigV2.
EXPOSE 8000 8080
CMD ["mha-serving", "serve", "--models", "/home/ray/models", "--host", "0.0.0.0", "--port", "8000"]
