"""benchmarks/harness/cluster.py's node start: a `ray start` that exits before its node is alive is cleaned up and
started again, as Kubernetes restarts a pod's container, and past its attempts the error names the log that holds
every attempt. Real `ray start` processes, refused by Ray itself (a negative CPU count) before they start a node."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from benchmarks.harness.cluster import LocalCluster

pytestmark = pytest.mark.slow


def test_a_node_whose_ray_start_exits_is_started_again_and_past_its_attempts_the_error_names_its_log():
    root = Path(tempfile.mkdtemp(prefix="rch", dir="/tmp"))  # short: Ray's socket paths would live under it
    cluster = LocalCluster(root)
    try:
        with pytest.raises(RuntimeError, match="exited 2 times") as failed:
            cluster.start_alive("bad", cpus=-1, gpus=0, head=True, attempts=2)
        log = root / "bad.log"
        assert str(log) in str(failed.value) and cluster.nodes == []
        assert log.read_text().count("Resource quantities must be nonnegative") == 2
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
