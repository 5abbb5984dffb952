"""docker-compose.yml agrees with the code: commands the CLI accepts, environment variables the
settings classes read, ports that match the scrape targets, volumes where the settings point."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import pytest

from demo import MODEL_DIR
from engine.api.settings import EngineSettings
from gateway.settings import GatewaySettings
from ragblend.cli import build_parser
from retriever.settings import RetrieverSettings
from tests.deploy.deploy_files import (
    APP_SERVICES,
    DATASOURCES,
    REPO_ROOT,
    compose_services,
    compose_value,
    dashboard,
    dockerfile_env,
    load_yaml,
    ragblend_services,
    scrape_targets,
)

SETTINGS = {"retriever": RetrieverSettings, "engine": EngineSettings, "gateway": GatewaySettings}
DESIGN_PORTS = {"gateway": 8000, "retriever": 8001, "engine": 8002}
IMAGE_WORKDIR = PurePosixPath("/app")


def subcommand(service: dict) -> str:
    return build_parser().parse_args(service["command"]).command


def effective_env(service: dict) -> dict[str, str]:
    """The container's environment: the image's ENV overridden by the compose file's."""
    env = dict(dockerfile_env())
    env.update({k: compose_value(v) for k, v in service.get("environment", {}).items()})
    return env


def settings_of(service: dict, monkeypatch: pytest.MonkeyPatch):
    """The service's settings class built from the container's environment."""
    name = subcommand(service)
    for key, value in effective_env(service).items():
        monkeypatch.setenv(key, value)
    return SETTINGS[name]()


def volume_targets(service: dict) -> dict[str, str]:
    """container path -> named volume."""
    named = load_yaml(REPO_ROOT / "docker-compose.yml").get("volumes", {})
    mounts = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if source in named:
            mounts[target] = source
    return mounts


def test_the_stack_has_the_three_services_prometheus_and_grafana():
    assert {*APP_SERVICES, "prometheus", "grafana"} <= set(compose_services())


@pytest.mark.parametrize("name", sorted(ragblend_services()))
def test_every_service_command_is_a_ragblend_subcommand_the_cli_accepts(name):
    service = ragblend_services()[name]
    assert subcommand(service) in SETTINGS, f"{name}: {service['command']}"


@pytest.mark.parametrize("name", sorted(ragblend_services()))
def test_every_ragblend_variable_set_is_a_field_of_the_services_settings(name):
    service = ragblend_services()[name]
    settings_class = SETTINGS[subcommand(service)]
    prefix = settings_class.model_config["env_prefix"]
    fields = set(settings_class.model_fields)
    for key in service.get("environment", {}):
        assert key.startswith(prefix), f"{name} sets {key}, which its service does not read"
        assert key[len(prefix) :].lower() in fields, f"{name}: {key} is not a setting"


def test_every_ragblend_variable_of_the_image_is_a_setting():
    known = {
        cls.model_config["env_prefix"] + field.upper()
        for cls in SETTINGS.values()
        for field in cls.model_fields
    }
    unknown = {k for k in dockerfile_env() if k.startswith("RAGBLEND_")} - known
    assert not unknown, f"the Dockerfile sets variables no settings class reads: {unknown}"


@pytest.mark.parametrize("name", sorted(ragblend_services()))
def test_the_settings_accept_the_environment_of_every_service(name, monkeypatch):
    settings_of(ragblend_services()[name], monkeypatch)


@pytest.mark.parametrize("name", APP_SERVICES)
def test_ports_are_designs_and_match_the_published_port_and_the_scrape_target(name, monkeypatch):
    service = compose_services()[name]
    port = settings_of(service, monkeypatch).port
    assert port == DESIGN_PORTS[name]
    assert f"{port}:{port}" in service["ports"]
    assert scrape_targets()[subcommand(service)] == [f"{name}:{port}"]


def test_the_gateway_reaches_the_retriever_and_engine_by_service_name_and_port(monkeypatch):
    settings = settings_of(compose_services()["gateway"], monkeypatch)
    assert settings.retriever_url == f"http://retriever:{DESIGN_PORTS['retriever']}"
    assert settings.engine_urls == [f"http://engine:{DESIGN_PORTS['engine']}"]


@pytest.mark.parametrize("name", sorted(ragblend_services()))
def test_state_lives_in_named_volumes_where_the_settings_point(name, monkeypatch):
    service = ragblend_services()[name]
    settings = settings_of(service, monkeypatch)
    mounts = volume_targets(service)
    paths = {
        "retriever": lambda s: [s.data_dir],
        "engine": lambda s: [s.store_path],
        "gateway": lambda s: [],
    }[subcommand(service)](settings)
    for path in paths:
        resolved = IMAGE_WORKDIR / PurePosixPath(path)  # a relative default is under WORKDIR
        assert str(resolved) in mounts, f"{name}: {resolved} is not a named volume ({mounts})"
    if subcommand(service) in ("retriever", "engine"):
        assert "/models" in mounts, f"{name} lacks the models volume"


def test_volumes_of_index_kv_store_and_models_are_named_and_distinct():
    services = compose_services()
    assert volume_targets(services["retriever"])["/data/retriever"] == "index"
    assert volume_targets(services["engine"])["/data/kv"] == "kvstore"
    assert volume_targets(services["engine"])["/models"] == "models"


def test_the_default_model_is_the_bundled_demo_model_inside_the_image(monkeypatch):
    model = settings_of(compose_services()["engine"], monkeypatch).model
    relative = MODEL_DIR.resolve().relative_to(REPO_ROOT)
    assert model == str(IMAGE_WORKDIR / relative.as_posix())
    assert dockerfile_env()["RAGBLEND_ENGINE_MODEL"] == model
    assert re.search(r"^WORKDIR /app$", (REPO_ROOT / "Dockerfile").read_text(), re.M)


def test_the_gateway_waits_for_a_healthy_retriever_and_engine_and_all_have_healthchecks():
    services = compose_services()
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    depends = services["gateway"]["depends_on"]
    for dependency in ("retriever", "engine"):
        assert depends[dependency]["condition"] == "service_healthy"


def test_the_gpu_engine_is_a_profile_reserving_an_nvidia_gpu(monkeypatch):
    service = compose_services()["engine-gpu"]
    assert service["profiles"] == ["gpu"]
    device = service["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert settings_of(service, monkeypatch).device == "cuda"


def test_grafana_mounts_the_provisioning_and_the_dashboards_use_its_datasource_uid():
    mounts = dict(v.split(":")[:2] for v in compose_services()["grafana"]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./deploy/grafana/dashboards"] == "/var/lib/grafana/dashboards"
    provider = load_yaml(REPO_ROOT / "deploy/grafana/provisioning/dashboards/ragblend.yml")
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    uids = {
        source["uid"]
        for path in DATASOURCES.glob("*.yml")
        for source in load_yaml(path)["datasources"]
    }
    used = {
        target["datasource"]["uid"]
        for panel in dashboard()["panels"]
        for target in panel["targets"]
    }
    assert used and used <= uids
    mounts = dict(v.split(":")[:2] for v in compose_services()["prometheus"]["volumes"])
    assert mounts["./deploy/prometheus"] == "/etc/prometheus"
