"""The documentation stays true to the code: every AppConfig field is in docs/configuration.md, the README stays a
README, the benchmarks report stays a report, and relative links resolve, down to their #anchor in a Markdown page."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from service.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]


def _fields(model: type[BaseModel]) -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        for kind in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                names |= _fields(kind)
    return names


def test_every_config_field_is_documented_in_the_configuration_page():
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(name for name in _fields(AppConfig) if f"`{name}`" not in page)
    assert not missing, f"not in docs/configuration.md: {missing}"


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, a repeated
    one suffixed -1, -2, ... (fenced code is not headings)."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (heading := re.match(r"#{1,6} (.+)", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchor, n = slug, 0
            while anchor in anchors:
                n += 1
                anchor = f"{slug}-{n}"
            anchors.add(anchor)
    return anchors


def test_the_readme_is_short_and_its_relative_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}"


def test_every_anchor_a_page_links_to_is_a_heading_there():
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target) if target else page
            local_page = "://" not in target and linked.suffix == ".md" and linked.exists()
            if local_page and anchor not in _anchors(linked):
                broken.append(f"{page.name} -> {target or page.name}#{anchor}")
    assert not broken, f"links to headings that do not exist: {broken}"


def test_the_benchmarks_report_is_a_report_and_its_history_is_kept_apart():
    """docs/benchmarks.md holds each study's command, latest figures and bar; earlier runs go to the history."""
    report = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(report.splitlines()) <= 250
    assert "(benchmarks-history.md)" in report and (ROOT / "docs" / "benchmarks-history.md").exists()
