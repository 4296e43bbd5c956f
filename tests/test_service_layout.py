"""The shape of the serving package, read from its sources: no import cycle among its modules, no module over 300
lines and a thin Serve deployment class, each request limit compared in one module, Ray's exceptions caught in one,
and each gRPC RPC named once in handler code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ROOT / "service"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trees() -> dict[str, ast.Module]:
    return {_module(p): ast.parse(p.read_text()) for p in sorted(SERVICE.rglob("*.py"))}


def _module_level_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The service modules a module imports when it is imported (not inside functions or TYPE_CHECKING)."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle in `graph` (module -> modules it imports), or [] where there is none."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle_and_passes_a_chain():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_among_the_service_modules():
    trees = _trees()
    modules = set(trees)
    graph = {name: _module_level_imports(tree, modules) - {name} for name, tree in trees.items()}
    assert _cycle(graph) == []


def test_no_service_module_is_longer_than_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in SERVICE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert long == {}


def test_the_serve_deployment_class_is_a_shell_of_at_most_120_lines():
    tree = ast.parse((SERVICE / "ingress.py").read_text())
    (ingress,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Ingress"]
    first = min(d.lineno for d in ingress.decorator_list)
    assert ingress.end_lineno - first + 1 <= 120


LIMIT_FIELDS = {
    "max_body_bytes",
    "max_header_bytes",
    "max_headers",
    "max_rows",
    "body_timeout_s",
    "max_connections",
    "max_in_flight",
}


def _compared_limits(tree: ast.Module) -> list[int]:
    """Lines comparing a request limit (a RequestLimits field, or a name of one) with anything."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for part in ast.walk(node):
            name = part.attr if isinstance(part, ast.Attribute) else part.id if isinstance(part, ast.Name) else ""
            if name in LIMIT_FIELDS:
                lines.append(node.lineno)
                break
    return lines


def test_the_request_limits_are_compared_in_one_module():
    """service.config compares the settings with each other when they load; requests meet them in service.limits."""
    where = {name: lines for name, tree in _trees().items() if (lines := _compared_limits(tree))}
    assert set(where) - {"service.config"} == {"service.limits"}, where


def test_rays_exceptions_are_caught_in_one_module():
    ray_errors = ("ray.exceptions", "ray.serve.exceptions")
    where = set()
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ray_errors:
                where.add(name)
    assert where == {"service.remote_calls"}


def _rpc_names() -> list[str]:
    from contract.rpc import inference_pb2 as pb

    return [m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods] + ["Check", "Watch"]


@pytest.mark.parametrize("rpc", _rpc_names())
def test_each_grpc_rpc_is_named_once_in_the_services_handler_code(rpc):
    places = []
    for path in sorted(SERVICE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            named = node.value if isinstance(node, ast.Constant) else getattr(node, "name", None)
            if named == rpc and isinstance(node, ast.Constant | ast.FunctionDef | ast.AsyncFunctionDef):
                places.append(str(path.relative_to(ROOT)))
    assert places == ["service/rpc/rpcs.py"]
