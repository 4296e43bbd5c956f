"""`mha-serving optimize`'s mistakes a user can make: each one line and exit status 2, before anything runs."""

from __future__ import annotations

import pytest

from optimize import cli
from optimize.arguments import parse_budget


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--slo-p99-ms", "50"], "the following arguments are required: --model"),
        (["--model", "{model}"], "give the SLO"),
        (["--model", "{missing}", "--slo-p99-ms", "50"], "is not an exported model folder"),
        (["--model", "{model}", "--slo-rate", "-3"], "--slo-rate must be positive"),
        (["--model", "{model}", "--slo-rate", "10", "--budget", "soon"], "--budget must be a positive duration"),
        (["--model", "{model}", "--slo-rate", "10", "--keep", "1,1.5"], "--keep fractions must be within (0, 1]"),
        (["--model", "{model}", "--slo-rate", "10", "--rollout", "shadow"], "needs --route NAME"),
        (["--model", "{model}", "--slo-rate", "10", "--rollout-steps", "10,50"], "end at 100"),
        (["--model", "{model}", "--slo-rate", "10", "--headroom", "-0.1"], "--headroom must be a fraction"),
    ],
)
def test_each_bad_input_is_one_line_and_exit_status_2(argv, says, tiny_models_dir, tmp_path, capsys):
    paths = {"model": str(tiny_models_dir / "mha-h2-d32"), "missing": str(tmp_path / "nothing")}
    assert cli.main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mha-serving optimize: ") and says in err[0], err


def test_a_rollout_without_the_services_token_is_refused(tiny_models_dir, monkeypatch, capsys):
    monkeypatch.delenv("MHA_REPOSITORY_TOKEN", raising=False)
    argv = ["--model", str(tiny_models_dir / "mha-h2-d32"), "--slo-rate", "10", "--rollout", "shadow", "--route", "r"]
    assert cli.main(argv) == 2
    assert "MHA_REPOSITORY_TOKEN" in capsys.readouterr().err


def test_budgets_read_as_a_person_writes_them():
    assert [parse_budget(t) for t in ("20m", "90s", "1.5h", "300")] == [1200, 90, 5400, 300]
