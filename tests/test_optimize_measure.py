"""The measurement stage of `mha-serving optimize`: a tiny model served for real by `mha-serving serve` with a
generated config and driven by the load tester in short windows; the record, the checkpoint a rerun resumes from,
the budget, a server that cannot start. The search space, the budget and the checkpoint's torn line also on their own.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
from pathlib import Path

import pytest
from conftest import export_tiny_model

from optimize.checkpoint import MEASUREMENTS_FILE, Checkpoint
from optimize.measure import MeasurePlan, measure
from optimize.measurement import Measurement, Window
from optimize.report import Slo
from optimize.search import Budget, search
from optimize.server import PortInUseError, Server
from optimize.settings import SearchSpace, ServingSettings

SLO = Slo(p99_ms=500.0, rate=20.0)  # generous: the figures, not the verdict, are checked on 2 busy cores
# ~5 s of load a measurement; the start estimate is below any real start, so a budget of one estimate fits one
PLAN = MeasurePlan(
    window_s=1.0, warmup_s=0.3, min_windows=2, max_windows=2, rate_steps=1, saturation_concurrency=8,
    startup_estimate_s=0.5,
)  # fmt: skip
ONE_CORE = {"processes": (1,), "intra_op_threads": (1,), "batch_wait_ms": (0.0,), "cores": 2}


class Counted:
    """measure(), counting the servers it starts."""

    def __init__(self) -> None:
        self.calls: list[ServingSettings] = []

    def __call__(self, folder, settings, *args):
        self.calls.append(settings)
        return measure(folder, settings, *args)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return export_tiny_model(tmp_path_factory.mktemp("models"), heads=2, seed=2).folder


@pytest.fixture(scope="module")
def first(model, tmp_path_factory):
    """Two settings of one core each and a budget of one measurement's estimate: one is measured for real."""
    out = tmp_path_factory.mktemp("optimize")
    space = SearchSpace(max_batch_size=(8, 32), coarse_batch_sizes=(8, 32), **ONE_CORE)
    counted = Counted()
    lines: list[str] = []
    budget = PLAN.estimate_s(SLO) + 0.01
    result = search([model], SLO, PLAN, out, budget, space, counted, lines.append, confirm=False)
    return out, result, counted, lines


@pytest.mark.slow
@pytest.mark.serve
def test_a_measurement_records_real_figures_from_the_run(first, model):
    _, result, _, _ = first
    (m,) = result.measurements
    assert m.failure == "" and m.candidate == model.name and m.precision == "fp32"
    assert m.settings == ServingSettings(1, 1, 8, 0.0) and m.cores == 1
    assert len(m.at_rate) == PLAN.max_windows
    for w in (*m.at_rate, m.saturation, *m.rate_probes):
        assert w.ok > 0 and w.rps > 0 and w.seconds >= PLAN.window_s and w.cores == 1
        assert 0 < w.p50_ms <= w.p99_ms and math.isfinite(w.p99_ms)
    assert all(w.mode == "open" and w.level == SLO.rate for w in m.at_rate)
    assert m.saturation.mode == "closed" and m.saturation.level == PLAN.saturation_concurrency
    assert min(w.p99_ms for w in m.at_rate) <= m.p99_ms <= max(w.p99_ms for w in m.at_rate)
    # the rate search starts from half the saturation throughput, or between the SLO's rate and saturation
    assert len(m.rate_probes) == 1 and 0 < m.rate_probes[0].level <= m.saturation.rps
    assert m.ready_s > 0 and m.exit_status == 0 and m.seconds > m.ready_s


@pytest.mark.slow
@pytest.mark.serve
def test_the_budget_stops_the_search_after_one_measurement(first):
    _, result, counted, lines = first
    assert counted.calls == [ServingSettings(1, 1, 8, 0.0)]
    assert result.stopped_by == "budget" and result.measured == 1
    assert any("budget spent" in line and "p1-t1-b32-w0" in line for line in lines)


@pytest.mark.slow
@pytest.mark.serve
def test_the_checkpoint_holds_the_measurement_and_a_rerun_starts_no_server(first, model):
    out, result, _, _ = first
    lines = (out / MEASUREMENTS_FILE).read_text().splitlines()
    assert len(lines) == 1
    recorded = json.loads(lines[0])
    assert recorded["key"] == result.measurements[0].key and recorded["saturation"]["ok"] > 0
    counted = Counted()
    space = SearchSpace(max_batch_size=(8,), coarse_batch_sizes=(8,), **ONE_CORE)
    again = search([model], SLO, PLAN, out, 3600, space, counted, lambda line: None, confirm=False)
    assert counted.calls == [] and again.measured == 0 and again.reused == 1
    assert again.measurements == result.measurements and again.best == result.measurements[0]


@pytest.mark.slow
@pytest.mark.serve
def test_a_server_that_cannot_start_is_recorded_as_failed_and_the_search_goes_on(first, model):
    out, result, _, _ = first
    counted = Counted()
    lines: list[str] = []
    space = SearchSpace(max_batch_size=(0, 8), coarse_batch_sizes=(0, 8), **ONE_CORE)  # batch 0: the server refuses
    again = search([model], SLO, PLAN, out, 3600, space, counted, lines.append, confirm=False)
    assert counted.calls == [ServingSettings(1, 1, 0, 0.0)]
    failed, reused = again.measurements
    assert failed.settings.max_batch_size == 0 and "max_batch_size" in failed.failure
    assert "exited with status 2" in failed.failure and failed.at_rate == () and not failed.meets()
    assert reused == result.measurements[0] and again.best == reused
    assert Checkpoint(out).get(failed.key) == failed  # recorded: a rerun will not start it again


@pytest.mark.slow
@pytest.mark.serve
def test_the_choice_is_measured_again_on_a_fresh_server_and_recorded_apart(first, model, tmp_path):
    out, result, _, _ = first
    shutil.copytree(out, tmp_path / "out")
    counted = Counted()
    space = SearchSpace(max_batch_size=(8,), coarse_batch_sizes=(8,), **ONE_CORE)
    again = search([model], SLO, PLAN, tmp_path / "out", 3600, space, counted, lambda line: None)
    (chosen,) = again.measurements
    (confirmation,) = again.confirmations
    assert counted.calls == [chosen.settings] and chosen == result.measurements[0]  # the search's own, reused
    assert confirmation.confirms and confirmation.key == chosen.key + "|confirms" and confirmation.ready_s > 0
    assert confirmation.saturation.ok > 0 and confirmation.measured_at >= chosen.measured_at
    assert (tmp_path / "out" / "servers" / f"{model.name}-{chosen.settings.key}-confirms").is_dir()
    recorded = Checkpoint(tmp_path / "out")
    assert recorded.get(chosen.key) == chosen and recorded.get(confirmation.key) == confirmation
    assert again.best == chosen  # the generous SLO holds on the fresh server too


def _recorded(candidate: str, p99_ms: float, max_rate: float, cores: int = 1) -> Measurement:
    window = Window("open", SLO.rate, 1.0, 20, 20, {}, 0, 20.0, p99_ms / 2, p99_ms, cores, 1.0)
    settings = ServingSettings(processes=cores)
    return Measurement(candidate, f"/{candidate}", settings, SLO, cores, at_rate=(window,), p99_ms=p99_ms,
                       max_rate=max_rate, seconds=1.0)  # fmt: skip


class Replayed:
    """measure() as recorded: each call answers the next figures queued for that candidate (no server)."""

    def __init__(self, queued: dict[str, list[Measurement]]) -> None:
        self.queued, self.calls = queued, []

    def __call__(self, folder, settings, *args):
        self.calls.append(folder.name)
        return self.queued[folder.name].pop(0)


def test_a_choice_a_fresh_run_refutes_is_set_aside_and_the_next_is_confirmed(tmp_path):
    space = SearchSpace(max_batch_size=(8,), coarse_batch_sizes=(8,), **ONE_CORE)
    replayed = Replayed({
        "knee": [_recorded("knee", 100.0, 30.0), _recorded("knee", 900.0, 10.0)],  # at its knee: a fresh run misses
        "steady": [_recorded("steady", 200.0, 40.0), _recorded("steady", 210.0, 38.0)],
    })  # fmt: skip
    result = search([tmp_path / "knee", tmp_path / "steady"], SLO, PLAN, tmp_path, 3600, space, replayed, print)
    assert replayed.calls == ["knee", "steady", "knee", "steady"]
    assert result.best.candidate == "steady" and [c.candidate for c in result.confirmations] == ["knee", "steady"]
    assert "confirmed on a fresh server: p99 200.0 -> 210.0 (1.05 x)" in result.why


def test_a_rate_slo_with_headroom_is_met_only_by_a_configuration_holding_the_spare_rate(tmp_path):
    space = SearchSpace(max_batch_size=(8,), coarse_batch_sizes=(8,), **ONE_CORE)
    slo = Slo(SLO.p99_ms, SLO.rate, headroom=0.5)  # 30 req/s to hold within the bar
    replayed = Replayed({"tight": [_recorded("tight", 100.0, 25.0)], "spare": [_recorded("spare", 300.0, 31.0)]})
    result = search([tmp_path / "tight", tmp_path / "spare"], slo, PLAN, tmp_path, 3600, space, replayed, print,
                    confirm=False)  # fmt: skip
    assert result.best.candidate == "spare" and "31 req/s held within the p99 bar (1.55 x" in result.why
    tight = result.measurements[0]
    assert tight.meets(SLO) and not tight.meets(slo)


@pytest.mark.slow
@pytest.mark.serve
def test_a_port_taken_before_the_server_binds_it_is_a_typed_error_and_a_failed_measurement(model, tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("optimize.server.free_port", lambda: port)  # every port chosen is the one held
            with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is in use"):
                Server(model, ServingSettings(), tmp_path / "start").start()
            measured = measure(model, ServingSettings(), SLO, PLAN, tmp_path / "measure", lambda line: None)
    assert f"port {port} on 127.0.0.1 is in use" in measured.failure and measured.saturation is None


def test_the_coarse_grid_spreads_the_cores_fewest_first_and_neighbours_are_one_step_away():
    space = SearchSpace.for_machine(8)
    grid = space.coarse()
    assert [s.cores(8) for s in grid] == sorted(s.cores(8) for s in grid)
    assert grid[0] == ServingSettings(1, 1, 32, 0.0) and all(s.processes * s.intra_op_threads <= 8 for s in grid)
    assert {(s.processes, s.intra_op_threads) for s in grid if s.cores(8) == 8} == {(2, 4), (4, 2), (8, 1)}
    around = space.neighbours(ServingSettings(2, 2, 8, 2.0))
    assert set(around) == {
        ServingSettings(1, 2, 8, 2.0), ServingSettings(4, 2, 8, 2.0), ServingSettings(2, 1, 8, 2.0),
        ServingSettings(2, 4, 8, 2.0), ServingSettings(2, 2, 1, 2.0), ServingSettings(2, 2, 32, 2.0),
        ServingSettings(2, 2, 8, 0.0), ServingSettings(2, 2, 8, 5.0),
    }  # fmt: skip
    assert ServingSettings(4, 4, 8, 2.0) not in space.neighbours(ServingSettings(4, 2, 8, 2.0))  # 16 > 8 cores


def test_a_budget_allows_a_measurement_only_while_its_estimate_fits():
    now = [0.0]
    budget = Budget(100.0, clock=lambda: now[0])
    assert budget.allows(100.0)
    now[0] = 60.0
    assert budget.allows(40.0) and not budget.allows(40.5)


def test_a_torn_checkpoint_line_is_skipped_and_the_next_record_stays_readable(tmp_path):
    window = Window("open", 20.0, 1.0, 20, 20, {}, 0, 20.0, 3.0, 9.0, 1, 1.0)
    record = Measurement("m", "/m", ServingSettings(), SLO, 1, at_rate=(window,), p99_ms=9.0, seconds=30.0)
    Checkpoint(tmp_path).add(record)
    with open(tmp_path / MEASUREMENTS_FILE, "a") as f:
        f.write('{"key": "m|p2')  # killed mid-line
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.unreadable == 1 and checkpoint.get(record.key) == record
    other = Measurement("m", "/m", ServingSettings(2), SLO, 2, failure="did not start")
    checkpoint.add(other)
    reread = Checkpoint(tmp_path)
    assert reread.unreadable == 1 and reread.get(other.key) == other and reread.get(record.key) == record
    assert record.meets() and not other.meets() and record.point().p99_ms == 9.0
