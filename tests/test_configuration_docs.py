"""Every environment variable the code reads is a row of docs/configuration.md's tables of variables, and every row
there is one the code reads.

"Read by the code", found with the AST in every module of service/, contract/, loadtest/ and export/ (whole packages,
not named files, so the check holds as modules move), is two kinds of name:

- what our code reads itself: `os.environ[NAME]`, `os.environ.get(NAME)`, `os.getenv(NAME)`, `NAME in os.environ`
  (and `environ`/`getenv` imported from os), where NAME is a string literal or a module-level string constant
  (`PROXY_LIMITS_VAR = "MHA_PROXY_LIMITS"`), defined in that module or, under a unique name, in another one;
- what our code sets for Ray and Serve to read: the keys of every dict literal whose keys are all such names shaped
  like a variable (`{"RAY_worker_niceness": "0", **OTHER}`: the launcher's settings, which it puts in its
  environment with setdefault, so a value the user exports wins) and every name written with `os.environ[NAME] = ...`
  or `os.environ.setdefault(NAME, ...)`. The user can set each of these, so each needs its row.

A read whose name cannot be resolved from the source (a variable, a call) fails the test, saying where: a check
that asks is better than one that misses a variable. Not counted: variables only third-party code reads
(`RAY_metrics_report_interval_ms`, named in prose as one you may set), and benchmarks/ and tests/, which are not
shipped.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "contract", "loadtest", "export")
# An upper-case prefix, then one or more `_part`s: RAY_worker_niceness, MHA_PROXY_LIMITS, CUDA_VISIBLE_DEVICES.
VARIABLE = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Za-z0-9]+)+")


def _modules() -> dict[Path, ast.Module]:
    return {
        path: ast.parse(path.read_text(), filename=str(path))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "text"` (annotated or not)."""
    found = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        target = node.target if isinstance(node, ast.AnnAssign) else target
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
            found[target.id] = value.value
    return found


class _Scanner(ast.NodeVisitor):
    """Collects the variables one module reads or sets, and the reads it cannot resolve."""

    def __init__(self, path: Path, own: dict[str, str], shared: dict[str, str | None]):
        self.path, self.own, self.shared = path, own, shared
        self.names: set[str] = set()
        self.unresolved: list[str] = []

    def resolve(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        return self.own.get(name) or self.shared.get(name) if name else None

    def read(self, key: ast.expr, node: ast.AST) -> None:
        name = self.resolve(key)
        if name is None:
            self.unresolved.append(f"{self.path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        else:
            self.names.add(name)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if _is_environ(node.value):
            if isinstance(node.ctx, ast.Load):
                self.read(node.slice, node)
            elif (name := self.resolve(node.slice)) is not None:
                self.names.add(name)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        method = func.attr if isinstance(func, ast.Attribute) and _is_environ(func.value) else None
        getenv = (isinstance(func, ast.Attribute) and func.attr == "getenv" and _is_os(func.value)) or (
            isinstance(func, ast.Name) and func.id == "getenv"
        )
        if node.args and (getenv or method == "get"):
            self.read(node.args[0], node)
        elif node.args and method == "setdefault" and (name := self.resolve(node.args[0])) is not None:
            self.names.add(name)  # an unresolved key here is a loop over a dict of settings: counted at the dict
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, ast.In | ast.NotIn) and _is_environ(right):
                self.read(node.left, node)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        keys = [self.resolve(key) for key in node.keys if key is not None]  # None: a `**other` splat
        if keys and all(key is not None and VARIABLE.fullmatch(key) for key in keys):
            self.names.update(keys)
        self.generic_visit(node)


def _is_os(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "os"


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and _is_os(node.value)) or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


@functools.cache
def variables_in_code() -> tuple[dict[str, set[str]], list[str]]:
    """Variable -> the modules that read or set it; and the reads whose variable cannot be told."""
    modules = _modules()
    constants = {path: _constants(tree) for path, tree in modules.items()}
    values: dict[str, set[str]] = defaultdict(set)
    for own in constants.values():
        for name, value in own.items():
            values[name].add(value)
    shared = {name: next(iter(found)) for name, found in values.items() if len(found) == 1}
    where: dict[str, set[str]] = defaultdict(set)
    unresolved: list[str] = []
    for path, tree in modules.items():
        scanner = _Scanner(path, constants[path], shared)
        scanner.visit(tree)
        for name in scanner.names:
            where[name].add(str(path.relative_to(ROOT)))
        unresolved += scanner.unresolved
    return where, unresolved


def variables_in_docs() -> set[str]:
    """The backticked names in the first column of every table of configuration.md whose first header is
    `variable`."""
    names: set[str] = set()
    in_table = False
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            in_table = False
        elif not in_table:
            in_table = cells[0] == "variable"
        elif not set(cells[0]) <= set("-: "):
            names |= set(re.findall(r"`([^`]+)`", cells[0]))
    return names


def test_the_scan_finds_what_the_code_reads_and_sets():
    where, unresolved = variables_in_code()
    assert not unresolved, f"environment reads whose variable the test cannot tell: {unresolved}"
    # One of each kind, so that the scan cannot pass by finding nothing: a constant read, a literal read, a setting.
    assert {"MHA_PROXY_LIMITS", "CUDA_VISIBLE_DEVICES", "RAY_worker_niceness"} <= where.keys(), sorted(where)


def test_every_variable_the_code_reads_is_in_the_configuration_page():
    where, _ = variables_in_code()
    missing = {name: sorted(where[name]) for name in sorted(where.keys() - variables_in_docs())}
    assert not missing, f"not in a `variable` table of docs/configuration.md: {missing}"


def test_every_variable_in_the_configuration_page_is_read_by_the_code():
    documented = variables_in_docs()
    assert documented, "docs/configuration.md has no table whose first column is `variable`"
    stale = sorted(documented - variables_in_code()[0].keys())
    assert not stale, f"docs/configuration.md lists variables no code reads or sets: {stale}"
