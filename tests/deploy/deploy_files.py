"""The deployment files as data for the tests: docker-compose.yml, the Prometheus config and
rules, the Grafana dashboard's panel expressions. (Imported as tests.deploy.deploy_files.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE = REPO_ROOT / "docker-compose.yml"
COMPOSE_OVERRIDES = REPO_ROOT / "deploy/compose"
ENV_EXAMPLE = REPO_ROOT / ".env.example"
SMOKE_TEST = REPO_ROOT / "deploy/podman/smoke-test.sh"
DOCKERFILE = REPO_ROOT / "Dockerfile"
PROMETHEUS_CONFIG = REPO_ROOT / "deploy/prometheus/prometheus.yml"
ALERTS = REPO_ROOT / "deploy/prometheus/alerts.yml"
DATASOURCES = REPO_ROOT / "deploy/grafana/provisioning/datasources"
DASHBOARD = REPO_ROOT / "deploy/grafana/dashboards/ragblend.json"
APP_SERVICES = ("retriever", "engine", "gateway")

# What a dashboard variable stands for when every value is selected (the panels use =~).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*", "$mode": ".*"}
# ${NAME}, ${NAME:-default}, ${NAME:?error}: the interpolations the compose files use.
_VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::([-?])([^}]*))?\}")
# The secrets that the compose file requires, as the tests' shell sets them.
COMPOSE_ENV = {
    "RAGBLEND_INTERNAL_TOKEN": "test-internal-token",
    "GRAFANA_ADMIN_PASSWORD": "test-grafana-password",
}


class MissingVariable(KeyError):
    """A ${NAME:?error} variable is unset or empty: compose refuses to start."""


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def compose_services() -> dict[str, dict]:
    return load_yaml(COMPOSE)["services"]


def ragblend_services() -> dict[str, dict]:
    """The compose services that run the ragblend image (engine-gpu included)."""
    return {
        name: service
        for name, service in compose_services().items()
        if service.get("image", "").startswith("ragblend:")
    }


def compose_value(value: object, env: dict[str, str] = COMPOSE_ENV) -> str:
    """A compose value as the container sees it when the shell's variables are `env`."""

    def substitute(match: re.Match) -> str:
        name, kind, argument = match.groups()
        if env.get(name):
            return env[name]
        if kind == "?":
            raise MissingVariable(f"{name}: {argument}")
        return argument if kind == "-" else env.get(name, "")

    return _VARIABLE.sub(substitute, str(value))


def compose_variables(path: Path = COMPOSE) -> dict[str, str | None]:
    """Every variable a compose file reads -> "-" (has a default), "?" (required) or None."""
    return {name: kind or None for name, kind, _ in _VARIABLE.findall(path.read_text())}


def dockerfile_env() -> dict[str, str]:
    """The ENV of the Dockerfile's last (runtime) stage."""
    stage = DOCKERFILE.read_text().split("\nFROM ")[-1]
    env: dict[str, str] = {}
    for block in re.findall(r"^ENV (.*?)(?<!\\)$", stage.replace("\\\n", " "), re.M):
        for key, value in re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", block):
            env[key] = value
    return env


def scrape_targets() -> dict[str, list[str]]:
    """job name -> its static targets, from deploy/prometheus/prometheus.yml."""
    config = load_yaml(PROMETHEUS_CONFIG)
    return {
        job["job_name"]: [t for static in job["static_configs"] for t in static["targets"]]
        for job in config["scrape_configs"]
    }


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_targets() -> list[tuple[str, str]]:
    """(panel title and refId, PromQL) of every target of every dashboard panel."""
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def grafana_to_promql(expr: str) -> str:
    """The expression Grafana sends with every variable at "All"."""
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"an unknown Grafana variable is left in {expr!r}"
    return expr


def alert_rules() -> list[tuple[str, str]]:
    """(alert name, expression) of every alerting rule."""
    return [
        (rule["alert"], rule["expr"])
        for group in load_yaml(ALERTS)["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]
