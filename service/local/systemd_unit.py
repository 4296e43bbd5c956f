"""Whether `mha-serving serve` runs as a systemd service whose stop cannot drain. With systemd's default
KillMode=control-group a stop sends SIGTERM to every process of the unit at once: Ray's GCS, raylet and the serving
processes exit on it before the launcher can drain them, and requests in progress are cut. KillMode=mixed
(deploy/systemd/mha-serving.service) signals the launcher only. The launcher says so at start, not at the first stop.
No Ray. No torch.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

UNIT_ENV = "INVOCATION_ID"  # set by systemd for the processes of a unit it starts (systemd.exec(5))
CGROUP = Path("/proc/self/cgroup")
CUTTING_MODE = "control-group"  # SIGTERM to every process of the unit (mixed and process: to the launcher only)
SYSTEMCTL_TIMEOUT_S = 5.0


def unit_of(cgroup: str) -> tuple[str, bool] | None:
    """/proc/PID/cgroup's text -> (the service unit the process runs in, whether it is a user unit), or None outside
    a service (a login session's scope, a container's root). cgroup v2's line (`0::PATH`) or v1's systemd one
    (`N:name=systemd:PATH`); the innermost `.service` of the path (a unit with Delegate=yes may nest cgroups)."""
    for line in cgroup.splitlines():
        fields = line.split(":", 2)  # hierarchy id, controllers, path
        if len(fields) != 3 or fields[1] not in ("", "name=systemd"):
            continue
        parts = fields[2].strip("/").split("/")
        services = [i for i, part in enumerate(parts) if part.endswith(".service")]
        if not services:
            return None
        last = services[-1]
        if parts[last].startswith("user@"):  # the user manager itself, not a unit it runs
            return None
        return parts[last], any(part.startswith("user@") for part in parts[:last])
    return None


def kill_mode(unit: str, user: bool) -> str | None:
    """The unit's KillMode as systemctl shows it, or None if systemctl cannot say."""
    command = ["systemctl", *(["--user"] if user else []), "show", "--property=KillMode", "--value", unit]
    try:
        shown = subprocess.run(command, capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return shown.stdout.strip() or None


def stop_warning(environ: Mapping[str, str] = os.environ, cgroup: Path = CGROUP) -> str | None:
    """One line for the operator when this process is a systemd service that a stop will not drain, else None."""
    if not environ.get(UNIT_ENV):
        return None
    try:
        found = unit_of(cgroup.read_text())
    except OSError:
        return None
    if found is None:
        return None
    unit, user = found
    if kill_mode(unit, user) != CUTTING_MODE:
        return None
    return (
        f"mha-serving serve: systemd unit {unit} has KillMode={CUTTING_MODE}: a stop sends SIGTERM to Ray's processes "
        "too, they exit at once and requests in progress are cut; set KillMode=mixed "
        "(deploy/systemd/mha-serving.service)"
    )
