"""Shared fixtures: tiny models built and exported here (no downloads), once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TINY = {"d_model": 32, "layers": 1, "ff_dim": 64, "max_len": 32}  # exports in a few seconds


def export_tiny_model(out_dir: Path, heads: int, seed: int = 0, attention: bool = False, **overrides):
    """Build an untrained tiny EncoderClassifier with `heads` heads and export it through the normal path."""
    import torch

    from export.convert import export_model, exporter_versions
    from export.model import AttentionOutputs, EncoderClassifier, EncoderConfig

    torch.manual_seed(seed)
    config = EncoderConfig(heads=heads, **{**TINY, **overrides})
    model = EncoderClassifier(config)
    variant = AttentionOutputs(model) if attention else None
    return export_model(model, config.metadata(exporter_versions()), out_dir, attention_variant=variant)


def export_tiny_decoder(
    out_dir: Path, kv_heads: int, max_len: int, seed: int, d_model: int = 32, layers: int = 2, spread: bool = True
) -> None:
    """Build an untrained tiny DecoderLM (4 query heads) and export it through the normal path. `spread`: weights
    times 4, because an untrained model's logits are nearly equal (init std 0.02) and greedy choices would then mean
    nothing from step to step."""
    import torch

    from export import decoder_export
    from export.decoder import DecoderConfig, DecoderLM

    torch.manual_seed(seed)
    config = DecoderConfig(d_model=d_model, heads=4, kv_heads=kv_heads, layers=layers, max_len=max_len)
    model = DecoderLM(config)
    if spread:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(4.0)
    decoder_export.export_decoder(model.eval(), model.config.metadata(), out_dir)


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    """A models/ folder with two tiny head configurations, mha-h2-d32 and mha-h4-d32 (the latter with attention)."""
    out = tmp_path_factory.mktemp("models")
    export_tiny_model(out, heads=2, seed=2)
    export_tiny_model(out, heads=4, seed=4, attention=True)
    return out


def _gpu_available() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers() and Path("/dev/nvidia0").exists()


# Files whose tests read the session Ray's metrics export (through a real Prometheus, or the load tester's own
# scrape): the first to use the session's Ray, while the export is small. Ray's agent keeps the series of every
# replica the session ever ran (~10,000 series, ~5 MB by the end of a full run), and a scrape late in the session
# took 1-9 s on 2 busy cores.
METRICS_EXPORT_FILES = {
    "test_metrics.py",
    "test_pruned_serving.py",
    "test_loadtest_service.py",
    "test_loadtest_routes.py",
}


# `make test` runs two lanes (pytest-xdist, two workers, --dist loadgroup): every test of a Ray, the session's or a
# server of its own, one after another in one lane (two Ray clusters on 2 cores starve each other), beside the other
# files. Half of 2 cores sat idle with one lane: a server starts on about one core, one process after another.
RAY_LANE = "ray"
# The Ray lane's own-server files in this order. The first ones check what is served rather than how fast or how
# soon: they run while the other lane's CPU-bound files (training, export; ~300-480 s) take a core beside them. Last,
# those that time the service or start two servers at once (Ray gives a node 30 s to register, and two starts on
# busy cores once took longer).
OWN_SERVER_ORDER = (
    "test_deploy_cluster.py",  # first: before the session's Ray, which it would otherwise run beside
    "test_grpc_proxy.py",
    "test_optimize_measure.py",
    "test_launcher.py",
    "test_metrics_bounded.py",
    "test_routes.py",
    "test_repository.py",
    "test_processes.py",
    "test_reliability.py",
    "test_soak_bench.py",
    "test_stop_signals.py",
    "test_scale_bench.py",
    "test_slow_heads.py",
)


def uses_ray(item) -> bool:
    """Whether the test runs on the session's Ray or starts a Ray of its own (marked `serve` or `ray`)."""
    marked = item.get_closest_marker("serve") or item.get_closest_marker("ray")
    return "serve_port" in item.fixturenames or marked is not None


def lane(item) -> str:
    """The Ray lane, or for any other test its file: a unit of its own, its module fixtures (models trained,
    exported) built once, handed whole to whichever worker is free."""
    return RAY_LANE if uses_ray(item) else item.path.name


def _run_order(item) -> tuple[int, int]:
    """The queue: the Ray lane first (given whole to one worker): the own-server files in OWN_SERVER_ORDER (any
    other after them), then the files that scrape the session Ray's metrics export (while it is small), then the
    rest of the session's tests; after it, the other files one by one, to the other worker."""
    name = item.path.name
    if not uses_ray(item):
        return 1, 0
    last = len(OWN_SERVER_ORDER)
    if "serve_port" not in item.fixturenames:
        return 0, OWN_SERVER_ORDER.index(name) if name in OWN_SERVER_ORDER else last
    return 0, last + (1 if name in METRICS_EXPORT_FILES else 2)


def pytest_configure(config):
    """In a lane of `make test`: torch and numpy on one thread each. The lanes share 2 cores, and OpenMP's threads
    spin while they wait for a core the other lane holds."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_itemcollected(item):
    """Each test's lane, as an xdist_group (before any collection_modifyitems hook, where xdist reads them)."""
    item.add_marker(pytest.mark.xdist_group(lane(item)))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the process that hands the tests out
def pytest_xdist_node_collection_finished(node, ids):
    """Under `make test`'s lanes: every test id carries its lane, where --dist loadgroup reads it, or the run stops
    here (a pytest or pytest-xdist that loses the groups would run two Rays at once on the 2 cores)."""
    if node.config.getoption("dist") == "loadgroup":
        lost = [nodeid for nodeid in ids if nodeid.rfind("@") <= nodeid.rfind("]")]  # "[a@b]": no lane
        if lost:
            raise pytest.UsageError(f"pytest-xdist's --dist loadgroup lost the lanes of {len(lost)} tests: {lost[0]}")


@pytest.hookimpl(trylast=True)  # after pytest has grouped the tests of each fixture param
def pytest_collection_modifyitems(config, items):
    """The order of the queue `make test` hands its two workers (kept there by --no-loadscope-reorder; a plain
    `pytest` runs the same order in one process). Tests marked `gpu` need onnxruntime-gpu and an NVIDIA device;
    skipped (saying so) otherwise."""
    items.sort(key=_run_order)  # stable: keeps each file's tests in order
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and onnxruntime-gpu (CUDAExecutionProvider)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def metrics_port() -> int:
    """The port of the session Ray's metrics export (Prometheus text at /metrics)."""
    from serving import free_port

    return free_port()


@pytest.fixture(scope="session")
def serve_grpc_port() -> int:
    """The port of the session Serve's gRPC proxy (the way in for gRPC on a cluster)."""
    from serving import free_port

    return free_port()


@pytest.fixture(scope="session")
def serve_port(metrics_port, serve_grpc_port):
    """One embedded Ray (2 CPUs) with Serve on a free 127.0.0.1 port for the whole session; its HTTP port."""
    from serving import start_ray_and_serve, stop_ray

    port = start_ray_and_serve(metrics_port, serve_grpc_port)
    yield port
    stop_ray()


PLACEMENTS = ["colocated", "deployment"]


@pytest.fixture(scope="session")
def session_apps() -> dict:
    """The applications deployed into the session's Ray, by name. Pytest sets a parametrized session fixture up
    again whenever the run order comes back to one of its params, and deploying again would restart its replicas."""
    return {}


@pytest.fixture(scope="session", params=PLACEMENTS)
def service(request, serve_port, tiny_models_dir, session_apps):
    """The real application on the tiny models (a small CPU share), once per placement: models co-located in the
    ingress at /, and each model in its own deployment (requests coalesced at the ingress, as `mha-serving serve`
    runs it) at /main-deployment. Every test that uses it runs against both."""
    from serving import deploy

    name = "main" if request.param == "colocated" else f"main-{request.param}"
    if name in session_apps:
        return session_apps[name]
    session_apps[name] = deploy(serve_port, name, tiny_models_dir, placement=request.param, ingress={"coalesce": True})
    return session_apps[name]


@pytest.fixture(scope="session", params=PLACEMENTS)
def limited_service(request, serve_port, tiny_models_dir, tmp_path_factory, session_apps):
    """A second application with tiny limits and three broken model folders next to a good one, under
    /limited-<placement>, once per placement."""
    from serving import broken_models_dir, deploy

    name = f"limited-{request.param}"
    if name in session_apps:
        return session_apps[name]
    models = broken_models_dir(tmp_path_factory.mktemp("limited") / "models", tiny_models_dir / "mha-h2-d32")
    settings = {"num_cpus": 0.1, "max_ongoing_requests": 1, "max_queued_requests": 1, "batch_wait_timeout_s": 0.5}
    limits = {"max_rows": 4, "max_body_bytes": 4096, "body_timeout_s": 1.0}
    session_apps[name] = deploy(
        serve_port,
        name,
        models,
        placement=request.param,
        deployment=settings,
        limits=limits,
        ingress={"coalesce": True},
    )
    return session_apps[name]
