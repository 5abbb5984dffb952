"""A real Prometheus server (the Debian package's binary) on a free 127.0.0.1 port, scraping
given targets with the repository's rules. (Imported as tests.deploy.prometheus_server.)"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.deploy_files import ALERTS, PROMETHEUS_CONFIG, load_yaml
from tests.service_process import free_port, wait_ready

SCRAPE_INTERVAL = "1s"


def local_config(targets: dict[str, str]) -> dict:
    """deploy/prometheus/prometheus.yml with each job's targets replaced by `targets[job]`
    (a 127.0.0.1 address), a 1 s scrape and rule evaluation, and the rules by absolute path."""
    config = load_yaml(PROMETHEUS_CONFIG)
    config["global"].update(scrape_interval=SCRAPE_INTERVAL, evaluation_interval=SCRAPE_INTERVAL)
    config["rule_files"] = [str(ALERTS)]
    config.pop("alerting", None)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    return config


@dataclass
class PrometheusServer:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def query(self, expr: str) -> dict:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30.0)
        return response.json()

    def get(self, path: str) -> dict:
        return httpx.get(f"{self.url}{path}", timeout=30.0).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_prometheus(targets: dict[str, str], workdir: Path) -> PrometheusServer:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (Debian package `prometheus`; .ci/run installs it)"
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(local_config(targets)))
    port = free_port()
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = PrometheusServer(proc, f"http://127.0.0.1:{port}", log_path)
    if wait_ready(proc, f"{server.url}/-/ready", 60):
        return server
    server.stop()
    pytest.fail(f"prometheus did not become ready:\n{log_path.read_text()}")
