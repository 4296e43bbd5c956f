"""`contract`, `service`, `loadtest`, `optimize` and `evaluation` import on a machine without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: a meta path finder makes `import torch` (and its submodules) fail, then every module
# of the given packages is imported; prints {"modules": [...], "failed": {module: error}} as JSON.
_PROBE = """
import importlib, importlib.abc, json, pkgutil, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by test_imports)", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
modules, failed = [], {}
targets = sys.argv[1:]
for package_name in [t for t in targets if not t.startswith("export.")]:
    package = importlib.import_module(package_name)
    modules.append(package_name)
    for info in pkgutil.walk_packages(package.__path__, prefix=package_name + "."):
        modules.append(info.name)
modules += [t for t in targets if t.startswith("export.")]
for name in modules:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"modules": modules, "failed": failed, "torch": "torch" in sys.modules}))
"""


def _probe(*targets: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *targets], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", ["contract", "service", "loadtest", "optimize", "evaluation"])
def test_every_module_of_the_package_imports_without_torch(package):
    result = _probe(package)
    assert len(result["modules"]) > 1, f"pkgutil found no modules in {package}"
    assert result["failed"] == {}
    assert result["torch"] is False


def test_the_probe_does_block_torch():
    result = _probe("export.model")
    assert "ModuleNotFoundError" in result["failed"]["export.model"]
    assert "torch" in result["failed"]["export.model"]


def _imports(folder: str) -> dict[str, set[str]]:
    """Each module file under `folder` -> the modules it imports (absolute, from the source's AST)."""
    import ast

    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("service", "export"),
        ("contract", "export"),
        ("contract", "service"),
        ("export", "service"),
        ("loadtest", "service"),
        ("optimize", "service"),
        ("optimize", "export"),
        ("loadtest", "optimize"),
        ("service", "optimize"),
        ("export", "optimize"),
    ],
)
def test_no_import_arrow_runs_against_the_layout(folder, forbidden):
    wrong = {
        f: sorted(n for n in names if n == forbidden or n.startswith(forbidden + "."))
        for f, names in _imports(folder).items()
    }
    assert not {f: n for f, n in wrong.items() if n}


def test_only_the_one_adapter_reaches_into_uvicorn_or_ray_internals():
    private = ("ray._private", "ray.serve._private", "uvicorn.protocols")
    reaching = {
        f: sorted(n for n in names if n.startswith(private))
        for f, names in _imports("service").items()
        if any(n.startswith(private) for n in names)
    }
    assert reaching == {
        "service/http/uvicorn_adapter.py": [
            "uvicorn.protocols.http.httptools_impl",
            "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol",
        ]
    }
    sources = "".join(p.read_text() for p in (ROOT / "service").rglob("*.py"))
    assert "_start_asgi_task" not in sources and "HTTP_PROTOCOLS" not in sources


def test_the_command_line_imports_no_ray_before_it_sets_rays_environment():
    """Ray reads its environment when first imported (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, which keeps a local Ray's
    ports on loopback, among them): `mha-serving serve` sets it in start_local, so nothing it imports before may
    import Ray."""
    code = "import sys, service.cli, service.local.launcher; print(sorted(m for m in sys.modules if m == 'ray'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
