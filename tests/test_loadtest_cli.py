"""The load tester's command line without a service: bad input gets one clear line and a non-zero exit."""

from __future__ import annotations

import json
import socket

import pytest

from loadtest.cli import main
from loadtest.discovery import DiscoveryError, ModelInfo, RemoteURLError, check_loopback, parse_model, select_models


def unused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1/", "http://[::1]:9", "https://127.0.0.2"])
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url, allow_remote=False) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1", "127.0.0.1:8000"])
def test_other_urls_are_refused_unless_allowed(url):
    with pytest.raises(RemoteURLError):
        check_loopback(url, allow_remote=False)


def test_remote_urls_pass_with_allow_remote():
    assert check_loopback("http://10.0.0.1:8000/", allow_remote=True) == "http://10.0.0.1:8000"


def test_model_listing_entries_parse_with_the_configuration_at_top_level_or_nested():
    flat = {"name": "m", "heads": 2, "head_dim": 16, "d_model": 32, "layers": 1, "max_len": 32, "ready": True}
    nested = {"name": "m", "config": {k: flat[k] for k in ("heads", "head_dim", "d_model", "layers")}, "max_len": 32}
    assert parse_model(flat) == parse_model(nested) == ModelInfo("m", 2, 16, 32, 1, 32, "", True)
    assert parse_model({"name": "loading", "ready": False, "error": "starting"}).ready is False
    with pytest.raises(DiscoveryError, match="no integer 'max_len'"):
        parse_model({"name": "m", "heads": 2, "head_dim": 16, "d_model": 32, "layers": 1, "ready": True})


def test_a_model_entry_without_precision_reads_as_fp32_and_a_variant_keeps_its_precision_and_source():
    entry = {"name": "mha-h8-d64", "heads": 8, "head_dim": 8, "d_model": 64, "layers": 1, "max_len": 32}
    assert parse_model(entry).precision == "fp32" and parse_model(entry).quantized_from == ""
    assert parse_model(entry | {"precision": None, "quantized_from": None}).precision == "fp32"
    variant = parse_model(entry | {"name": "mha-h8-d64-int8", "precision": "int8", "quantized_from": "mha-h8-d64"})
    assert (variant.heads, variant.precision, variant.quantized_from) == (8, "int8", "mha-h8-d64")
    assert variant.to_json()["precision"] == "int8"  # the report's model list says it too


def test_v2_model_metadata_gives_the_head_configuration_and_precision_from_its_parameters():
    parameters = {"heads": 8, "head_dim": 8, "d_model": 64, "layers": 1, "max_len": 32, "precision": "int8"}
    model = parse_model({"name": "mha-h8-d64-int8", "versions": ["1"], "parameters": parameters})
    assert (model.heads, model.max_len, model.precision, model.ready) == (8, 32, "int8", True)


def test_all_models_run_by_h_with_each_int8_variant_right_after_its_fp32_source():
    models = [
        ModelInfo("mha-h4-d32-int8", 4, 8, 32, 1, 32, precision="int8"),
        ModelInfo("mha-h4-d32", 4, 8, 32, 1, 32),
        ModelInfo("mha-h2-d32", 2, 16, 32, 1, 32),
    ]
    assert [m.name for m in select_models(models, "all")] == ["mha-h2-d32", "mha-h4-d32", "mha-h4-d32-int8"]


def test_selecting_an_unknown_model_names_the_ones_served():
    models = [ModelInfo("mha-h4-d32", 4, 8, 32, 1, 32), ModelInfo("mha-h2-d32", 2, 16, 32, 1, 32)]
    assert [m.heads for m in select_models(models, "all")] == [2, 4]
    assert [m.heads for m in select_models(models, "mha-h4-d32")] == [4]
    with pytest.raises(DiscoveryError, match=r"unknown model\(s\) nope; the service serves: mha-h2-d32, mha-h4-d32"):
        select_models(models, "mha-h2-d32,nope")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "http://10.0.0.1:8000"], "not a loopback address"),
        (["--concurrency", "0"], "--concurrency '0': every value must be > 0"),
        (["--concurrency", "", "--rate", ""], "nothing to run"),
        (["--rate", "fast"], "--rate 'fast' is not a comma-separated list"),
        (["--duration", "0"], "--duration must be > 0"),
        (["--seq-len", "gauss:3"], "--seq-len 'gauss:3'"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--protocol", "v2,json"], "--protocol 'v2,json': unknown protocol(s) json; give one or more of"),
        (["--protocol", "grpc,grpc"], "--protocol 'grpc,grpc' names grpc more than once"),
        (["--protocol", "v2", "--grpc-url", "127.0.0.1:8001"], "--grpc-url is for --protocol grpc"),
        (
            ["--protocol", "v2,grpc", "--grpc-url", "10.0.0.1:8001"],
            "--grpc-url 'http://10.0.0.1:8001' is not a loopback",
        ),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args, message, capsys, tmp_path):
    assert main([*args, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("mha-serving loadtest: ") and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_an_unreachable_service_exits_2_with_a_report_saying_nothing_was_measured(capsys, tmp_path):
    url = f"http://127.0.0.1:{unused_port()}"
    assert main(["--url", url, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot reach the service" in err and "\n" not in err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["status"] == "failed" and report["levels"] == []
    assert report["message"].startswith("nothing measured: cannot reach the service")
    assert "Nothing was measured." in (tmp_path / "r" / "report.md").read_text()
