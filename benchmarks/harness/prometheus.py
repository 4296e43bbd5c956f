"""A real Prometheus server on loopback, started from the project's deploy/prometheus.yml with its scrape target
replaced: the tests' metrics checks and the metrics churn benchmark read what it stored."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import yaml

from benchmarks.harness.polling import until, wait_for_http
from service.local.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"


class PrometheusServer:
    """Starts `prometheus` with deploy/prometheus.yml, its scrape target replaced by `target`, on a free port."""

    def __init__(self, target: str, scrape_interval: str = "2s", binary: str = "prometheus") -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = Path(tempfile.mkdtemp(prefix="mha-prometheus-"))
        config = yaml.safe_load(PROMETHEUS_YML.read_text())
        config["global"]["scrape_interval"] = scrape_interval
        config["global"]["evaluation_interval"] = scrape_interval
        config["global"]["scrape_timeout"] = scrape_interval  # Prometheus's most: a scrape may take its whole interval
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [target]
        rules = [PROMETHEUS_YML.parent / r for r in config.get("rule_files", [])]
        config["rule_files"] = [str(r) for r in rules if r.exists()]
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.process: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> PrometheusServer:
        self._log = open(self.workdir / "prometheus.log", "wb")  # closed in __exit__
        self.process = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_http(self.port, "/-/ready", 30, self.process)
        except RuntimeError as exc:
            log = (self.workdir / "prometheus.log").read_text(errors="replace")[-2000:]
            self.__exit__(None, None, None)
            raise RuntimeError(f"prometheus: {exc}: {log}") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def query(self, promql: str) -> list[dict]:
        """An instant query through the HTTP API; returns the result vector."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        response.raise_for_status()
        body = response.json()
        if body["status"] != "success":
            raise RuntimeError(f"prometheus refused {promql!r}: {body}")
        return body["data"]["result"]

    def wait_for(self, promql: str, predicate, timeout_s: float = 60.0) -> list[dict]:
        """Poll `promql` until predicate(result) holds (bounded by timeout_s); returns the last result."""
        last: list[list[dict]] = [[]]

        def holds() -> bool:
            last[0] = self.query(promql)
            return predicate(last[0])

        try:
            until(repr(promql), holds, timeout_s, retried=())  # a failed query ends the wait
        except TimeoutError:
            targets = self.targets()
            raise TimeoutError(
                f"timed out after {timeout_s} s waiting on {promql!r}; last result: {last[0]}; targets: {targets}"
            ) from None
        return last[0]

    def scraped_since(self, t: float, timeout_s: float = 60.0) -> None:
        """Wait until a scrape that started after `t` (seconds since the epoch) is stored."""
        self.wait_for("timestamp(scrape_samples_scraped)", lambda r: r and float(r[0]["value"][1]) > t, timeout_s)

    def targets(self) -> list[dict]:
        """Each scrape target's health, last error and last scrape's duration (why a series may be missing)."""
        response = httpx.get(f"{self.url}/api/v1/targets", timeout=10)
        response.raise_for_status()
        keys = ("scrapeUrl", "health", "lastError", "lastScrapeDuration")
        return [{k: t.get(k) for k in keys} for t in response.json()["data"]["activeTargets"]]
