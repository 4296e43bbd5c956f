"""`mha-serving serve` and `up`: one-line errors a user can fix, and a real start (direct ingress on --port),
request, and clean SIGTERM shutdown."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from loopback_http import http_server
from serving import free_port, serve_process

from service.local import launcher, ports, ray_env, start_report, up


def test_missing_models_folder_is_one_line_and_exit_2(tmp_path, capsys):
    assert launcher.main(["--models", str(tmp_path / "nope"), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "models folder" in err and "does not exist" in err


def test_models_folder_without_models_is_one_line_and_exit_2(tmp_path, capsys):
    assert launcher.main(["--models", str(tmp_path), "--port", str(free_port())]) == 2
    assert "no model folders in" in capsys.readouterr().err


def test_port_in_use_is_one_line_and_exit_2(tiny_models_dir, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert launcher.main(["--models", str(tiny_models_dir), "--port", str(port)]) == 2
    assert f"HTTP port {port} on 127.0.0.1 is in use" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_busy_metrics_port_is_checked_where_ray_will_listen(tiny_models_dir, capsys, host):
    """Ray's metrics ports follow --host: loopback for a loopback host, else every interface (0.0.0.0)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--models", str(tiny_models_dir), "--host", host, "--port", str(free_port())]
        assert launcher.main([*args, "--metrics-port", str(port)]) == 2
    assert f"metrics port {port} on {ports.ray_host(host)} is in use" in capsys.readouterr().err


@pytest.mark.parametrize(
    "host,ray_host",
    [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"), ("0.0.0.0", "0.0.0.0"), ("192.0.2.7", "0.0.0.0")],
)
def test_ray_listens_on_loopback_unless_the_api_host_is_another(host, ray_host):
    env = ray_env.ray_env(host)
    on_loopback = ray_env.RAY_ON_LOOPBACK.items() <= env.items()
    assert ports.ray_host(host) == ray_host and on_loopback == (ray_host == "127.0.0.1")
    assert ray_env.LOCAL_RAY_ENV.items() <= env.items()


def test_serves_grpc_proxy_is_held_to_the_body_limit_only_where_it_serves_grpc():
    assert ray_env.ray_env("127.0.0.1", grpc_proxy_limit=4096)[ray_env.GRPC_PROXY_LIMIT_VAR] == "4096"
    assert ray_env.GRPC_PROXY_LIMIT_VAR not in ray_env.ray_env("127.0.0.1")


# In a fresh process, as the server starts Ray: SIGTERM ignored, Ray up and down, then whether the kernel still ignores
# SIGTERM for this process (SigIgn's bit for signal 15) and what the environment Ray's processes inherited held.
SHUTDOWN_PROBE = """
import os, signal
from service.local.ray_env import NO_FAILURE_SIGNAL_HANDLER, import_ray_for_the_server
import_ray_for_the_server()
import ray
inherited = os.environ.get(NO_FAILURE_SIGNAL_HANDLER)
ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False, log_to_driver=False)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ray.shutdown()
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(bool(int(status["SigIgn"], 16) >> (signal.SIGTERM - 1) & 1), inherited)
"""


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("user_value", [None, "0"], ids=["unset", "set-by-the-user"])
def test_the_servers_ray_shutdown_leaves_its_sigterm_handling_and_ray_processes_keep_their_handler(user_value):
    """The server's driver goes without Ray's failure-signal handler, whose removal at shutdown resets SIGTERM to its
    default; Ray's processes inherit no switch; a user's own value is theirs (and Ray's reset with it)."""
    env = {k: v for k, v in os.environ.items() if k != ray_env.NO_FAILURE_SIGNAL_HANDLER}
    if user_value is not None:
        env[ray_env.NO_FAILURE_SIGNAL_HANDLER] = user_value
    run = subprocess.run([sys.executable, "-c", SHUTDOWN_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    expected = ["True", "None"] if user_value is None else ["False", "0"]
    assert run.stdout.split()[-2:] == expected, run.stdout


def test_num_replicas_with_the_api_port_is_refused_in_one_line_naming_processes(tiny_models_dir, tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("ingress:\n  num_replicas: 2\n")
    assert launcher.main(["--models", str(tiny_models_dir), "--config", str(config), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "mha-serving serve: invalid config: ingress: ingress.port: the replicas on the ingress's own ports are "
        "`processes`; "
        "set num_replicas 1, no autoscaling"
    )


def test_more_serving_processes_than_cores_is_one_line_and_exit_2_before_ray_starts(tiny_models_dir, capsys):
    cores = len(os.sched_getaffinity(0))
    args = ["--models", str(tiny_models_dir), "--port", str(free_port()), "--processes", str(cores + 1)]
    assert launcher.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{cores + 1} serving processes" in err and f"{cores} cores" in err, err


def test_config_file_with_a_misspelt_setting_is_refused(tiny_models_dir, tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("deployment:\n  max_batch: 8\n")
    assert launcher.main(["--models", str(tiny_models_dir), "--config", str(config)]) == 2
    assert "invalid config: deployment.max_batch: Extra inputs are not permitted" in capsys.readouterr().err


def test_serve_config_file_args_are_read_and_flags_override_them(tmp_path):
    config = tmp_path / "serve_config.yaml"
    config.write_text("applications:\n  - name: mha\n    args:\n      models_dir: /elsewhere\n      backend: gpu\n")
    args = launcher.parse_args(["--config", str(config), "--models", "here"])
    loaded = launcher.load_config(args)
    assert loaded.models_dir == "here" and loaded.backend == "gpu"


def test_up_finds_which_default_models_are_missing(tiny_models_dir, tmp_path):
    assert up.missing_models(tmp_path) == ["mha-h1-d512", "mha-h2-d512", "mha-h4-d512", "mha-h8-d512", "mha-h16-d512"]
    (tmp_path / "mha-h8-d512").mkdir()
    (tmp_path / "mha-h8-d512" / "model.onnx").write_bytes(b"x")
    assert "mha-h8-d512" not in up.missing_models(tmp_path)


def test_up_trains_the_first_decoder_on_the_docs_corpus_when_it_is_missing_in_a_subprocess(tmp_path):
    assert up.DECODER == "lm-h4-kv1-d64" and up.decoder_missing(tmp_path)
    cmd = up.train_command(tmp_path)
    assert cmd[:4] == [sys.executable, "-m", "service.cli", "train"]  # torch stays out of the serving process
    options = dict(zip(cmd[4::2], cmd[5::2], strict=True))
    assert options == {
        "--task": "docs-lm",
        "--heads": "4",
        "--kv-heads": "1",
        "--d-model": "64",
        "--layers": "2",
        "--steps": str(up.LM_STEPS),
        "--out": str(tmp_path),
    }


@pytest.mark.slow
def test_ups_training_command_writes_the_decoder_that_up_looks_for(tmp_path):
    """The command as `up` runs it, with 2 steps instead of its hundreds (a later option wins in argparse)."""
    done = subprocess.run([*up.train_command(tmp_path), "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not up.decoder_missing(tmp_path)


@pytest.mark.serve
@pytest.mark.slow
def test_serve_starts_through_a_sighup_answers_on_its_port_logs_each_request_and_stops_cleanly_however_many_sigterms(
    tiny_models_dir, tmp_path
):
    """With --access-log, which the default start lacks only in its log (every ServerProcess test starts that). A
    SIGHUP while Ray starts (an operator's reload sent early) is a reload once the server is up, not its end. The
    stop: a SIGTERM every 0.1 s to the launcher and to its server process until they exit, as from an impatient
    operator or a stopper that signals every process: the second ends the drain, the rest come while Ray shuts down
    and must not turn a clean stop into an interrupted one (exit status 0)."""
    port, metrics_port, log = free_port(), free_port(), tmp_path / "serve.log"
    args = ["--models", str(tiny_models_dir), "--port", str(port), "--grpc-port", str(free_port())]
    args += ["--metrics-port", str(metrics_port), "--num-cpus", "2", "--access-log"]
    with serve_process(args, log, hangup_after="starting Ray") as (proc, text):
        assert f"http://127.0.0.1:{port}/v2/models/{{name}}/infer" in text and "/docs" in text
        assert f"http://127.0.0.1:{metrics_port}/metrics" in text
        assert "model mha-h2-d32: h=2 head_dim=16 d_model=32 on cpu" in text
        deadline = time.time() + 30
        while "reload: the routes and models are unchanged" not in log.read_text():  # the early SIGHUP's reload
            assert time.time() < deadline, "no reload within 30 s:\n" + log.read_text()
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/models/mha-h2-d32/predict", json={"text": "hi"}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "mha-h2-d32"
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).status_code == 200
        deadline = time.time() + 30
        while '"POST /v1/models/mha-h2-d32/predict HTTP/1.1" 200' not in log.read_text():  # uvicorn's line
            assert time.time() < deadline, "no access log line within 30 s:\n" + log.read_text()
            time.sleep(0.5)
        (server,) = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
        sent = 0
        while proc.poll() is None and sent < 300:  # serve_process checks the exit status
            for pid in (proc.pid, server):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            sent += 1
            time.sleep(0.1)
    text = log.read_text()
    assert "stopping without waiting" in text and "shutting down" in text and sent > 3, (sent, text[-2000:])
    # Ray's warning when ray.init runs off the main thread: the abandoned drain's thread connecting to a new Ray
    assert "not the main thread" not in text.split("shutting down")[1], text[-2000:]
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # the port is free again


def _answering(status: int, body: bytes, delay_s: float = 0.0) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler answering every GET with `status` and `body` after `delay_s`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(delay_s)
            with contextlib.suppress(ConnectionError):  # a client that gave up waiting
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    return Handler


def _report(port: int) -> argparse.Namespace:
    return argparse.Namespace(host="127.0.0.1", port=port, grpc_port=None, proxy=False, metrics_port=free_port())


def test_the_start_report_lists_the_models_and_without_a_list_says_why_and_goes_on(capsys, monkeypatch):
    """The report asks the public port, where a flood may hold the connection cap from the first second: what it
    cannot list must not stop a server that is up (it once raised KeyError on the cap's 503, and the server went)."""
    classifier = {"name": "m", "ready": True, "heads": 2, "head_dim": 16, "d_model": 32, "backend": "cpu"}
    decoder = {**classifier, "name": "lm", "arch": "decoder", "kv_heads": 1, "context_length": 128}
    listed = {"models": [classifier, decoder]}
    capped = {"error": "the server holds its limit of 50 connections; retry later"}
    monkeypatch.setattr(start_report, "REPORT_TIMEOUT_S", 0.3)
    with http_server(_answering(200, json.dumps(listed).encode())) as port:
        start_report.report(_report(port))
    out = capsys.readouterr().out
    assert "model m: h=2 head_dim=16 d_model=32 on cpu" in out
    assert (
        "model lm: h=2 kv_heads=1 context=128 head_dim=16 d_model=32 on cpu" in out and "/openai/v1/completions" in out
    )
    with http_server(_answering(503, json.dumps(capped).encode())) as port:
        start_report.report(_report(port))
    out = capsys.readouterr().out
    assert f"models: not listed at start (HTTP 503: {capped['error']}); GET http://127.0.0.1:{port}/v1/models" in out
    assert out.rstrip().endswith("Ctrl-C to stop.")
    with http_server(_answering(200, b"<html>", delay_s=1)) as port:
        start_report.report(_report(port))
    assert "models: not listed at start (ReadTimeout: " in capsys.readouterr().out
    with http_server(_answering(200, b"not json")) as port:
        start_report.report(_report(port))
    assert "models: not listed at start (HTTP 200: not json)" in capsys.readouterr().out


def test_free_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice():
    """A port chosen here and bound later by another process (Serve's proxy, a test cluster's Ray) is not one the
    kernel hands out meanwhile to a socket bound to port 0 or an outgoing connection."""
    ephemeral_low = ports.ephemeral_ports()[0]
    chosen = [ports.free_port() for _ in range(20)]
    assert len(set(chosen)) == 20 and all(ports.CHOSEN_PORTS[0] <= p < ephemeral_low for p in chosen)
