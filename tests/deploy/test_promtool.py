"""promtool (Debian package `prometheus`, installed by .ci/run) accepts the Prometheus config
and the alert rules; a missing promtool fails the test instead of skipping it."""

from __future__ import annotations

import shutil
import subprocess

from tests.deploy.deploy_files import ALERTS, PROMETHEUS_CONFIG


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (Debian package `prometheus`; .ci/run installs it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_prometheus_config_and_its_rule_files():
    result = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_alert_rules():
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
