"""docker-compose.yml agrees with the code (commands the CLI accepts, variables the settings
read, ports, scrape targets, volumes) and exposes little: two ports, secrets with no default;
the `scale` profile's engines share a bounded, password-protected Redis."""

from __future__ import annotations

import re
import tomllib
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import pytest

from engine.api.settings import EngineSettings
from gateway.settings import GatewaySettings
from ragblend.cli import build_parser
from retriever.settings import RetrieverSettings
from tests.deploy.deploy_files import (
    APP_SERVICES,
    COMPOSE_ENV,
    COMPOSE_OVERRIDES,
    DATASOURCES,
    DOCKERFILE,
    ENV_EXAMPLE,
    REPO_ROOT,
    SMOKE_TEST,
    MissingVariable,
    compose_services,
    compose_value,
    compose_variables,
    dashboard,
    dockerfile_env,
    load_yaml,
    ragblend_services,
    scrape_targets,
)

MAKEFILE = REPO_ROOT / "Makefile"
SETTINGS = {"retriever": RetrieverSettings, "engine": EngineSettings, "gateway": GatewaySettings}
DESIGN_PORTS = {"gateway": 8000, "retriever": 8001, "engine": 8002}
IMAGE_WORKDIR = PurePosixPath("/app")


def subcommand(service: dict) -> str:
    return build_parser().parse_args(service["command"]).command


def effective_env(service: dict, shell: dict[str, str] = COMPOSE_ENV) -> dict[str, str]:
    """The container's environment: the image's ENV overridden by the compose file's."""
    env = dict(dockerfile_env())
    env.update({k: compose_value(v, shell) for k, v in service.get("environment", {}).items()})
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
def test_ports_are_designs_and_match_the_declared_port_and_the_scrape_target(name, monkeypatch):
    service = compose_services()[name]
    port = settings_of(service, monkeypatch).port
    assert port == DESIGN_PORTS[name]
    declared = service.get("expose", []) + [
        spec.split(":")[-1] for spec in service.get("ports", [])
    ]
    assert str(port) in declared
    assert scrape_targets()[subcommand(service)] == [f"{name}:{port}"]


def test_only_the_gateway_and_grafana_are_published_and_on_loopback_by_default():
    services = compose_services()
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"gateway", "grafana"}
    for name, port in (("gateway", 8000), ("grafana", 3000)):
        (spec,) = services[name]["ports"]
        assert compose_value(spec) == f"127.0.0.1:{port}:{port}"
        assert compose_value(spec, {"RAGBLEND_BIND": "0.0.0.0"}) == f"0.0.0.0:{port}:{port}"


def test_the_override_publishes_the_internal_services_prometheus_on_loopback_only():
    services = load_yaml(COMPOSE_OVERRIDES / "publish-internal.yml")["services"]
    for name in ("retriever", "engine"):
        (spec,) = services[name]["ports"]
        port = DESIGN_PORTS[name]
        assert compose_value(spec) == f"127.0.0.1:{port}:{port}"
        assert compose_value(spec, {"RAGBLEND_BIND": "0.0.0.0"}) == f"0.0.0.0:{port}:{port}"
    assert compose_value(services["prometheus"]["ports"][0], {"RAGBLEND_BIND": "0.0.0.0"}) == (
        "127.0.0.1:9090:9090"
    )
    assert set(services) <= set(compose_services())


def test_grafana_has_no_default_admin_password():
    password = compose_services()["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    with pytest.raises(MissingVariable, match="GRAFANA_ADMIN_PASSWORD"):
        compose_value(password, {})
    assert compose_value(password) == COMPOSE_ENV["GRAFANA_ADMIN_PASSWORD"]


@pytest.mark.parametrize("name", sorted(ragblend_services()))
def test_every_service_gets_the_one_required_internal_token(name):
    service = ragblend_services()[name]
    key = SETTINGS[subcommand(service)].model_config["env_prefix"] + "INTERNAL_TOKEN"
    value = service["environment"][key]
    with pytest.raises(MissingVariable, match="RAGBLEND_INTERNAL_TOKEN"):
        compose_value(value, {})
    assert effective_env(service)[key] == COMPOSE_ENV["RAGBLEND_INTERNAL_TOKEN"]


def test_gateway_api_keys_are_optional_from_the_environment_or_a_mounted_file():
    gateway = compose_services()["gateway"]
    assert effective_env(gateway)["RAGBLEND_GATEWAY_API_KEYS"] == ""
    keys = {**COMPOSE_ENV, "RAGBLEND_GATEWAY_API_KEYS": "k1,k2"}
    assert effective_env(gateway, keys)["RAGBLEND_GATEWAY_API_KEYS"] == "k1,k2"
    override = load_yaml(COMPOSE_OVERRIDES / "api-keys-file.yml")["services"]["gateway"]
    path = override["environment"]["RAGBLEND_GATEWAY_API_KEYS_FILE"]
    (mount,) = override["volumes"]
    shell = {"RAGBLEND_API_KEYS_FILE": "./keys.json"}
    assert compose_value(mount, shell) == f"./keys.json:{path}:ro"
    with pytest.raises(MissingVariable):
        compose_value(mount, {})


def test_env_example_lists_every_variable_and_the_smoke_test_exports_the_required_ones():
    example = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line and not line.startswith("#")
    )
    variables = compose_variables()
    assert set(variables) <= set(example), set(variables) - set(example)
    required = {name for name, kind in variables.items() if kind == "?"}
    assert required == set(COMPOSE_ENV)
    assert not any(example[name] for name in required), ".env.example must not hold a secret"
    smoke = SMOKE_TEST.read_text()
    for name in required:
        assert re.search(rf"^export .*\b{name}=", smoke, re.M), f"smoke-test.sh lacks {name}"


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


def test_the_default_model_is_the_bundled_smollm2_converted_into_the_image(monkeypatch):
    model = settings_of(compose_services()["engine"], monkeypatch).model
    assert model == str(IMAGE_WORKDIR / "models" / "smollm2")
    assert dockerfile_env()["RAGBLEND_ENGINE_MODEL"] == model
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"^WORKDIR /app$", dockerfile, re.M)
    assert f'ln -s "$converted" {model}' in dockerfile
    # One pin of the bundled model: the image's, the Makefile's and the constraints' agree.
    pin = re.search(r"^ARG BUNDLED_MODEL=(\S+)$", dockerfile, re.M).group(1)
    assert re.search(rf"^BUNDLED_MODEL := {re.escape(pin)}$", MAKEFILE.read_text(), re.M)
    assert pin in (REPO_ROOT / "constraints.txt").read_text().splitlines()


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


SCALE_ENGINES = ("scale-engine-1", "scale-engine-2")
REDIS_PORT = 6379


def test_the_scale_profile_has_two_engines_with_their_own_kv_sharing_one_redis(monkeypatch):
    services = compose_services()
    assert services["redis"]["profiles"] == ["scale"]
    kv_volumes = set()
    for name in SCALE_ENGINES:
        service = services[name]
        assert service["profiles"] == ["scale"]
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        url = urlsplit(effective_env(service)["RAGBLEND_ENGINE_REMOTE_URL"])
        assert (url.scheme, url.hostname, url.port, url.path) == ("redis", "redis", 6379, "/0")
        # Redis's password is the internal token, required like everywhere else.
        assert url.password == COMPOSE_ENV["RAGBLEND_INTERNAL_TOKEN"]
        kv_volumes.add(volume_targets(service)["/data/kv"])
        assert settings_of(service, monkeypatch).port == DESIGN_PORTS["engine"]
    assert len(kv_volumes) == 2 and "kvstore" not in kv_volumes
    assert str(REDIS_PORT) in services["redis"]["expose"]


def test_redis_is_pinned_unpublished_bounded_with_lru_eviction_and_a_password():
    redis = compose_services()["redis"]
    image, _, tag = redis["image"].partition(":")
    assert image == "redis" and re.match(r"\d+\.\d+\.\d+", tag), redis["image"]
    assert "ports" not in redis
    command = " ".join(redis["command"])
    assert re.search(r"--maxmemory \d+[kmg]b", command)
    assert "--maxmemory-policy allkeys-lru" in command
    assert "--save ''" in command and "--appendonly no" in command
    # The password reaches the server on its stdin, never its command line.
    assert "requirepass %s" in command and "$$REDISCLI_AUTH" in command
    with pytest.raises(MissingVariable, match="RAGBLEND_INTERNAL_TOKEN"):
        compose_value(redis["environment"]["REDISCLI_AUTH"], {})


def test_the_documented_scale_command_points_the_gateway_at_both_scale_engines(monkeypatch):
    guide = (REPO_ROOT / "docs/deployment.md").read_text()
    match = re.search(r"RAGBLEND_GATEWAY_ENGINE_URLS=(\S+)\s+docker compose --profile scale", guide)
    assert match, "docs/deployment.md shows how to start the scale profile"
    shell = {**COMPOSE_ENV, "RAGBLEND_GATEWAY_ENGINE_URLS": match.group(1)}
    for key, value in effective_env(compose_services()["gateway"], shell).items():
        monkeypatch.setenv(key, value)
    port = DESIGN_PORTS["engine"]
    assert GatewaySettings().engine_urls == [f"http://{name}:{port}" for name in SCALE_ENGINES]


def test_the_image_copies_every_package_that_pyproject_installs_and_imports_them_all():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    packages = {
        pattern.rstrip("*")
        for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    dockerfile = DOCKERFILE.read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, re.M))
    assert packages <= copied, f"the image lacks {sorted(packages - copied)}"
    check = re.search(r'python -c "import ([^"]+)"', dockerfile)
    assert check, "the build stage no longer imports the packages"
    assert {name.strip() for name in check.group(1).split(",")} == packages
