"""`contract`, `service` and `loadtest` import on a machine without torch."""

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


@pytest.mark.parametrize("package", ["contract", "service", "loadtest"])
def test_every_module_of_the_package_imports_without_torch(package):
    result = _probe(package)
    assert len(result["modules"]) > 1, f"pkgutil found no modules in {package}"
    assert result["failed"] == {}
    assert result["torch"] is False


def test_the_probe_does_block_torch():
    result = _probe("export.model")
    assert "ModuleNotFoundError" in result["failed"]["export.model"]
    assert "torch" in result["failed"]["export.model"]
