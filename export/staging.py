"""Writing an output folder all at once: files go to a temporary folder beside the target, which is renamed into
place only when everything is written, so a failure never leaves a half-written folder behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """Yields a temporary folder beside `target`; on success it replaces `target`, on any error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)
    try:
        yield staging
        move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def move_into_place(staging: Path, target: Path) -> None:
    """Rename staging to target; an existing target is renamed aside first, so readers never see a partial folder."""
    if not target.exists():
        os.replace(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    try:
        os.replace(target, old / target.name)
        try:
            os.replace(staging, target)
        except BaseException:
            os.replace(old / target.name, target)
            raise
    finally:
        if target.exists():  # never delete the only copy of a model
            shutil.rmtree(old, ignore_errors=True)
