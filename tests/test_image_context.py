"""The image's build context, checked offline: every file the wheel is built from gets through `.dockerignore` and the
build stage's COPY lines to where `pip wheel` reads it. Runs everywhere (no container engine): the image check that
would catch a missing package only runs where an engine is installed.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def ignore_patterns(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """`.dockerignore` as Docker's builders read it: (re-included?, regex) per line, in order."""
    patterns = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
        patterns.append((negated, re.compile(pattern_regex(pattern))))
    return patterns


def pattern_regex(pattern: str) -> str:
    """Docker's pattern syntax (moby/patternmatcher): `**` any number of directories, `*` and `?` within one."""
    if "[" in pattern or "\\" in pattern:
        raise ValueError(f"character classes and escapes are not read here: {pattern!r}")
    regex, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            i += 2 + pattern.startswith("/", i + 2)
            regex += ".*" if i == len(pattern) else "(.*/)?"
        else:
            regex += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return regex


def ignored(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """The last pattern matching the path or one of its parent directories decides; `!` re-includes."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for negated, regex in patterns:
        if any(regex.fullmatch(c) for c in candidates):
            verdict = not negated
    return verdict


def build_stage_copies() -> tuple[str, list[tuple[list[str], str]]]:
    """The directory `pip wheel` builds in the stage that runs it, and the COPY (sources, destination) pairs from the
    build context before it in that stage, destinations made absolute against WORKDIR."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    for stage in re.split(r"^FROM\s", text, flags=re.M | re.I)[1:]:
        workdir, copies = "/", []
        for line in stage.splitlines():
            instruction, _, rest = line.strip().partition(" ")
            if instruction.upper() == "WORKDIR":
                workdir = posixpath.join(workdir, rest.strip())
            elif instruction.upper() == "COPY":
                args = json.loads(rest) if rest.lstrip().startswith("[") else shlex.split(rest)
                if any(a.startswith("--from") for a in args):
                    continue  # from another stage, not from the context
                *sources, dest = [a for a in args if not a.startswith("--")]
                copies.append((sources, posixpath.join(workdir, dest)))
            elif instruction.upper() == "RUN" and (built := re.search(r"pip wheel\b[^&;|]*?\s(\S+)\s*(&&|$)", rest)):
                return posixpath.normpath(posixpath.join(workdir, built.group(1))), copies
    raise AssertionError("no stage of the Dockerfile runs `pip wheel`")


def landing(path: str, copies: list[tuple[list[str], str]]) -> str | None:
    """Where the COPY lines put a context file in the image (the last COPY that takes it wins), or None."""
    where = None
    for sources, dest in copies:
        for source in sources:
            if any(c in source for c in "*?["):
                raise ValueError(f"wildcard COPY sources are not read here: {source!r}")
            source = posixpath.normpath(source)
            if (ROOT / source).is_dir() and (source == "." or path.startswith(source + "/")):
                where = posixpath.join(dest, posixpath.relpath(path, source))
            elif source == path:
                into_dir = dest.endswith("/") or len(sources) > 1
                where = posixpath.join(dest, posixpath.basename(path)) if into_dir else dest
    return where and posixpath.normpath(where)


def wheel_sources() -> list[str]:
    """What `pip wheel .` reads: pyproject.toml, the readme it names, and every module of every package it installs
    (its packages.find applied to this tree, as setuptools applies it)."""
    find = dict(PYPROJECT["tool"]["setuptools"]["packages"]["find"])
    finder = setuptools.find_namespace_packages if find.pop("namespaces", True) else setuptools.find_packages
    packages = finder(str(ROOT / find.pop("where", ["."])[0]), **find)
    assert packages, f"pyproject.toml's packages.find {find} finds no package"
    readme = PYPROJECT["project"]["readme"]
    files = ["pyproject.toml", readme if isinstance(readme, str) else readme["file"]]
    for package in packages:
        files += sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / package.replace(".", "/")).glob("*.py"))
    return files


def test_every_file_the_wheel_is_built_from_reaches_the_build_stage_through_dockerignore_and_copy():
    patterns = ignore_patterns((ROOT / ".dockerignore").read_text())
    wheel_dir, copies = build_stage_copies()
    problems = []
    for path in wheel_sources():
        if ignored(path, patterns):
            problems.append(f"{path}: left out of the build context by .dockerignore")
        if (where := landing(path, copies)) != (target := posixpath.join(wheel_dir, path)):
            copied = f"copies it to {where}" if where else "does not copy it"
            problems.append(f"{path}: the build stage {copied}; `pip wheel` reads it at {target}")
    assert not problems, "the image's wheel would be built without:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("lines", "path", "left_out"),
    [
        (["**", "!service/"], "service/http/api.py", False),  # a re-included directory brings its whole tree
        (["**", "!service/"], "contract/metadata.py", True),
        (["**", "!service/", "**/__pycache__"], "service/http/__pycache__/api.cpython-311.pyc", True),
        (["**/__pycache__", "!service/"], "service/__pycache__/app.cpython-311.pyc", False),  # the last match wins
        (["*.md"], "docs/deploy.md", False),  # `*` stays within one directory
        (["**/*.md"], "README.md", True),  # `**/` matches no directory too
        (["# a comment", "/Makefile"], "Makefile", True),
    ],
)
def test_dockerignore_reading_follows_dockers_rules(lines, path, left_out):
    assert ignored(path, ignore_patterns("\n".join(lines))) is left_out
