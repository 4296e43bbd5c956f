"""A benchmark's bar: each line what was measured, what it had to meet and whether it did, and the Markdown table of
the lines that a report shows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    name: str
    measured: str
    bar: str
    ok: bool


def verdict_table(lines: list[Line]) -> str:
    out = ["| line | measured | bar | |", "| --- | --- | --- | --- |"]
    out += [f"| {x.name} | {x.measured} | {x.bar} | {'**pass**' if x.ok else '**FAIL**'} |" for x in lines]
    return "\n".join(out)
