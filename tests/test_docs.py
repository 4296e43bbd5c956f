"""The documentation stays true to the code: every AppConfig field is in docs/configuration.md, the README stays a
README, and its relative links resolve."""

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


def test_the_readme_is_short_and_its_relative_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}"
