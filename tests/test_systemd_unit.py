"""A systemd service whose stop cannot drain is told so at start (service/local/systemd_unit.py), and the unit the
project ships drains: systemd-analyze accepts it, its KillMode signals the launcher only, and its stop timeout
outlasts the launcher's own. The unit's KillMode is read through `systemctl`, here a stand-in on PATH (no systemd
runs in the test machine); the cgroup file is written as the kernel writes it."""

from __future__ import annotations

import configparser
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from service.limits import RequestLimits
from service.local import systemd_unit
from service.local.supervisor import STOP_MARGIN_S

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy" / "systemd" / "mha-serving.service"


def test_the_service_unit_is_read_from_the_cgroup_file_in_v2_v1_and_user_layouts():
    v2 = "0::/system.slice/mha-serving.service\n"
    v1 = "12:memory:/system.slice/other.service\n1:name=systemd:/system.slice/mha-serving.service\n"
    user = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/mha.service\n"
    delegated = "0::/system.slice/mha-serving.service/payload\n"
    assert systemd_unit.unit_of(v2) == ("mha-serving.service", False)
    assert systemd_unit.unit_of(v1) == ("mha-serving.service", False)
    assert systemd_unit.unit_of(user) == ("mha.service", True)
    assert systemd_unit.unit_of(delegated) == ("mha-serving.service", False)


def test_a_login_session_a_container_and_the_user_manager_are_no_service_unit():
    assert systemd_unit.unit_of("0::/user.slice/user-1000.slice/session-3.scope\n") is None
    assert systemd_unit.unit_of("0::/\n") is None
    assert systemd_unit.unit_of("0::/user.slice/user-1000.slice/user@1000.service/init.scope\n") is None
    assert systemd_unit.unit_of("") is None


@pytest.fixture
def systemctl(tmp_path, monkeypatch):
    """A `systemctl` first on PATH that prints the KillMode in $STAND_IN_MODE (exit 1 when it is empty) and records
    its arguments; returns the file of recorded calls."""
    calls = tmp_path / "systemctl-calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "systemctl"
    script.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ -n "$STAND_IN_MODE" ] || exit 1\necho "$STAND_IN_MODE"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def _cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cgroup"
    path.write_text(text)
    return path


UNDER_SYSTEMD = {systemd_unit.UNIT_ENV: "0123abcd"}


def test_a_unit_with_systemds_default_kill_mode_is_told_at_start_and_a_mixed_one_is_not(
    tmp_path, systemctl, monkeypatch
):
    cgroup = _cgroup(tmp_path, "0::/system.slice/mha-serving.service\n")
    monkeypatch.setenv("STAND_IN_MODE", "control-group")
    warning = systemd_unit.stop_warning(UNDER_SYSTEMD, cgroup)
    assert warning is not None and "mha-serving.service" in warning and "KillMode=control-group" in warning
    assert "KillMode=mixed" in warning
    assert systemctl.read_text().split("\n")[0] == "show --property=KillMode --value mha-serving.service"
    for mode in ("mixed", "process", "none"):  # the launcher alone is signalled, or nothing is
        monkeypatch.setenv("STAND_IN_MODE", mode)
        assert systemd_unit.stop_warning(UNDER_SYSTEMD, cgroup) is None


def test_a_user_unit_is_asked_of_the_users_manager(tmp_path, systemctl, monkeypatch):
    cgroup = _cgroup(tmp_path, "0::/user.slice/user-1000.slice/user@1000.service/app.slice/mha.service\n")
    monkeypatch.setenv("STAND_IN_MODE", "control-group")
    assert "mha.service" in (systemd_unit.stop_warning(UNDER_SYSTEMD, cgroup) or "")
    assert systemctl.read_text().strip() == "--user show --property=KillMode --value mha.service"


def test_nothing_is_said_outside_systemd_or_when_systemctl_cannot_tell(tmp_path, systemctl, monkeypatch):
    cgroup = _cgroup(tmp_path, "0::/system.slice/mha-serving.service\n")
    monkeypatch.setenv("STAND_IN_MODE", "control-group")
    assert systemd_unit.stop_warning({}, cgroup) is None
    assert not systemctl.exists()  # not asked: no INVOCATION_ID, no systemd unit
    assert systemd_unit.stop_warning(UNDER_SYSTEMD, tmp_path / "no-such-file") is None
    monkeypatch.setenv("STAND_IN_MODE", "")  # systemctl fails (no such unit, no manager to ask)
    assert systemd_unit.stop_warning(UNDER_SYSTEMD, cgroup) is None


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd's keys are case-sensitive
    parser.read(UNIT)
    return parser


def test_the_shipped_unit_drains_on_stop_and_outlasts_the_launchers_own_limit(tmp_path, systemctl, monkeypatch):
    service = _unit()["Service"]
    cgroup = _cgroup(tmp_path, "0::/system.slice/mha-serving.service\n")
    monkeypatch.setenv("STAND_IN_MODE", service["KillMode"])
    assert systemd_unit.stop_warning(UNDER_SYSTEMD, cgroup) is None
    assert systemctl.exists()  # asked, and told a mode that drains
    assert float(service["TimeoutStopSec"]) > RequestLimits().drain_s + STOP_MARGIN_S
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["ExecStart"].split()[:2] == ["/srv/mha-serving/.venv/bin/mha-serving", "serve"]
    assert service["RestartPreventExitStatus"] == "2"  # the launcher's status for a setting to fix


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze (Debian: systemd)")
def test_systemd_analyze_accepts_the_shipped_unit(tmp_path):
    """The unit as shipped, with its paths pointed at this checkout (verify checks that ExecStart exists)."""
    venv_bin = Path(sys.executable).parent
    text = UNIT.read_text().replace("/srv/mha-serving/.venv/bin", str(venv_bin)).replace("/srv/mha-serving", str(ROOT))
    unit = tmp_path / "mha-serving.service"
    unit.write_text(text)
    checked = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr  # systemd ignores a bad line, and says so
    broken = tmp_path / "broken" / "mha-serving.service"
    broken.parent.mkdir()
    broken.write_text(text.replace("KillMode=mixed", "KillMode=mixd"))
    refused = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "kill mode" in refused.stderr and "mixd" in refused.stderr  # the same check names a misspelt value
