"""deploy/k8s renders to objects valid against the Kubernetes schemas, and agrees with the code:
variables the settings read, ports, probes on open paths, engine URLs, secrets, dashboard."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from common.auth import INTERNAL_OPEN_PATHS
from engine.api.settings import EngineSettings
from gateway.auth import OPEN_PATHS as GATEWAY_OPEN_PATHS
from gateway.settings import GatewaySettings
from ragblend.cli import build_parser
from retriever.settings import RetrieverSettings
from tests.deploy.deploy_files import DASHBOARD, REPO_ROOT, dockerfile_env
from tests.deploy.k8s_render import UnsupportedKustomization, render, strategic_merge

K8S = REPO_ROOT / "deploy/k8s"
SETTINGS = {"retriever": RetrieverSettings, "engine": EngineSettings, "gateway": GatewaySettings}
DESIGN_PORTS = {"gateway": 8000, "retriever": 8001, "engine": 8002}
# The oldest Kubernetes these manifests target and the newest kubernetes-validate ships.
K8S_VERSIONS = ("1.30", "1.37")
# Custom resources (the Prometheus Operator's): no schema in kubernetes-validate; checked below.
CUSTOM_KINDS = frozenset({"ServiceMonitor"})
SECRETS = {"internal-token": "test-internal-token", "redis-password": "0123456789abcdef"}
ALL_COMPONENTS = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: ragblend-staging
resources: [../../base]
components: [../../components/gpu, ../../components/ingress, ../../components/prometheus-operator]
"""
RENDERINGS = {"base": "base", "gpu": "overlays/gpu", "all-components": "overlays/all-components"}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with secrets.env filled in, plus an overlay of every component."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("secrets.env"))
    example = (root / "base/secrets.env.example").read_text()
    filled = re.sub(
        r"^([a-z-]+)=$", lambda m: f"{m[1]}={SECRETS.get(m[1], '')}", example, flags=re.M
    )
    (root / "base/secrets.env").write_text(filled)
    (root / "overlays/all-components").mkdir()
    (root / "overlays/all-components/kustomization.yaml").write_text(ALL_COMPONENTS)
    return root


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[dict]]:
    return {name: render(tree / path) for name, path in RENDERINGS.items()}


def find(objects: list[dict], kind: str, name: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def ragblend_container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("ragblend:"), workload["metadata"]["name"]
    return container


def service_of(container: dict) -> str:
    return build_parser().parse_args(container["args"]).command


def ragblend_workloads(objects: list[dict]) -> dict[str, dict]:
    """service name (retriever, engine, gateway) -> its workload."""
    result = {}
    for workload in workloads(objects):
        containers = workload["spec"]["template"]["spec"]["containers"]
        if containers[0]["image"].startswith("ragblend:"):
            result[service_of(ragblend_container(workload))] = workload
    return result


def secret_values(objects: list[dict]) -> dict[tuple[str, str], str]:
    return {
        (o["metadata"]["name"], key): base64.b64decode(value).decode()
        for o in objects
        if o["kind"] == "Secret"
        for key, value in o.get("data", {}).items()
    }


def container_env(container: dict, objects: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: secrets resolved, $(NAME)
    expanded from the variables defined before, on top of the image's ENV."""
    secrets = secret_values(objects)
    env = dict(dockerfile_env())
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            ref = entry["valueFrom"]["secretKeyRef"]
            key = (ref["name"], ref["key"])
            if key not in secrets and ref.get("optional"):
                continue
            env[entry["name"]] = secrets[key]
        else:
            env[entry["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m[1], m[0]),
                entry["value"],
            )
    return env


def settings_of(service: str, objects: list[dict], monkeypatch: pytest.MonkeyPatch):
    for key in [k for k in os.environ if k.startswith("RAGBLEND_")]:
        monkeypatch.delenv(key)
    container = ragblend_container(ragblend_workloads(objects)[service])
    for key, value in container_env(container, objects).items():
        monkeypatch.setenv(key, value)
    return SETTINGS[service]()


def by_identity(objects) -> dict[tuple, dict]:
    return {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects}


def container_port(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def quantity_gib(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1, "mb": 1 / 1024, "gb": 1}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]+)", quantity).groups()
    return int(number) * units[unit]


# -- rendering and schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("rendering", RENDERINGS)
def test_every_rendered_object_is_valid_against_the_kubernetes_schema(rendering, version, rendered):
    objects = rendered[rendering]
    assert objects
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message}")


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_kubectl_kustomize_renders_the_same_objects(rendering, tree, rendered):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the offline renderer alone is checked")
    output = subprocess.run(
        [kubectl, "kustomize", str(tree / RENDERINGS[rendering])],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout

    expected = by_identity(yaml.safe_load_all(output))
    got = by_identity(rendered[rendering])
    assert set(got) == set(expected)
    for identity, obj in expected.items():
        assert got[identity] == obj, f"{identity} differs from kubectl kustomize"


def test_kustomize_refuses_to_render_without_the_secrets_file(tree, tmp_path):
    bare = tmp_path / "k8s"
    shutil.copytree(tree, bare, ignore=shutil.ignore_patterns("secrets.env"))
    with pytest.raises(FileNotFoundError, match="secrets.env"):
        render(bare / "base")
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        result = subprocess.run(
            [kubectl, "kustomize", str(bare / "base")], capture_output=True, text=True, timeout=60
        )
        assert result.returncode != 0 and "secrets.env" in result.stderr


def test_the_renderer_refuses_what_it_does_not_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nimages: [{name: ragblend}]\n")
    with pytest.raises(UnsupportedKustomization, match="images"):
        render(tmp_path)
    with pytest.raises(UnsupportedKustomization, match="ports"):
        strategic_merge({"spec": {"ports": [{"port": 1}]}}, {"spec": {"ports": [{"port": 2}]}})


def test_strategic_merge_merges_by_name_puts_patched_elements_first_and_deletes():
    target = {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}], "keep": 1}
    patch = {"env": [{"name": "B", "value": "3"}, {"name": "A", "$patch": "delete"}]}
    assert strategic_merge(target, patch) == {"env": [{"name": "B", "value": "3"}], "keep": 1}
    patch = {"env": [{"name": "C", "value": "4"}], "keep": None}
    assert strategic_merge(target, patch) == {"env": [{"name": "C", "value": "4"}, *target["env"]]}


# -- the settings


@pytest.mark.parametrize("rendering", ["base", "gpu"])
def test_every_ragblend_variable_is_a_setting_of_its_service(rendering, rendered):
    services = ragblend_workloads(rendered[rendering])
    assert set(services) == set(SETTINGS)
    for service, workload in services.items():
        settings_class = SETTINGS[service]
        prefix = settings_class.model_config["env_prefix"]
        for entry in ragblend_container(workload)["env"]:
            name = entry["name"]
            if not name.startswith("RAGBLEND_"):
                continue
            assert name.startswith(prefix), f"{service} sets {name}, which it does not read"
            assert name[len(prefix) :].lower() in settings_class.model_fields, (
                f"{service}: {name} is not a setting"
            )


@pytest.mark.parametrize("rendering", ["base", "gpu"])
@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_the_settings_accept_the_rendered_environment(service, rendering, rendered, monkeypatch):
    settings = settings_of(service, rendered[rendering], monkeypatch)
    assert settings.internal_token == SECRETS["internal-token"]


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_a_variable_reference_names_a_variable_defined_before_it(rendering, rendered):
    for workload in workloads(rendered[rendering]):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            defined: set[str] = set()
            for entry in container.get("env", []):
                for name in re.findall(r"\$\(([^)]*)\)", entry.get("value", "")):
                    assert name in defined, f"{entry['name']} refers to $({name}) before it is set"
                defined.add(entry["name"])
            for arg in container.get("args", []):
                for name in re.findall(r"\$\(([^)]*)\)", arg):
                    assert name in defined, f"{container['name']}: $({name}) in args is unset"


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_ports_of_the_container_service_probes_and_scrape_annotations_are_the_settings(
    service, rendered, monkeypatch
):
    objects = rendered["base"]
    port = settings_of(service, objects, monkeypatch).port
    assert port == DESIGN_PORTS[service]
    workload = ragblend_workloads(objects)[service]
    container = ragblend_container(workload)
    assert [p["containerPort"] for p in container["ports"]] == [port]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            assert container_port(container, container[probe]["httpGet"]["port"]) == port
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    (service_port,) = find(objects, "Service", service)["spec"]["ports"]
    assert service_port["port"] == port
    assert container_port(container, service_port["targetPort"]) == port


def test_probes_ask_paths_that_need_no_token_gateway_ready_engine_health(rendered):
    services = ragblend_workloads(rendered["base"])
    open_paths = {"gateway": GATEWAY_OPEN_PATHS, "engine": INTERNAL_OPEN_PATHS}
    open_paths["retriever"] = INTERNAL_OPEN_PATHS
    for service, workload in services.items():
        container = ragblend_container(workload)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["path"] in open_paths[service]
    gateway = ragblend_container(services["gateway"])
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert ragblend_container(services["engine"])["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_gateway_lists_each_engine_replica_by_its_stable_pod_name(rendered, monkeypatch):
    objects = rendered["base"]
    settings = settings_of("gateway", objects, monkeypatch)
    engine = find(objects, "StatefulSet", "engine")
    service = find(objects, "Service", engine["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "pod DNS names need a headless Service"
    port = service["spec"]["ports"][0]["port"]
    assert engine["spec"]["replicas"] >= 2
    assert settings.engine_urls == [
        f"http://engine-{i}.{service['metadata']['name']}:{port}"
        for i in range(engine["spec"]["replicas"])
    ]
    retriever = urlsplit(settings.retriever_url)
    (retriever_port,) = find(objects, "Service", retriever.hostname)["spec"]["ports"]
    assert retriever.port == retriever_port["port"] == DESIGN_PORTS["retriever"]


def test_engines_share_the_redis_service_with_its_password_and_lru_eviction(rendered):
    objects = rendered["base"]
    engine = ragblend_container(find(objects, "StatefulSet", "engine"))
    url = urlsplit(container_env(engine, objects)["RAGBLEND_ENGINE_REMOTE_URL"])
    (redis_port,) = find(objects, "Service", url.hostname)["spec"]["ports"]
    assert url.scheme == "redis" and url.port == redis_port["port"]
    assert url.password == SECRETS["redis-password"]
    (redis,) = find(objects, "Deployment", "redis")["spec"]["template"]["spec"]["containers"]
    args = redis["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert container_env(redis, objects)["REDIS_PASSWORD"] == SECRETS["redis-password"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    maxmemory = quantity_gib(args[args.index("--maxmemory") + 1])
    assert maxmemory < quantity_gib(redis["resources"]["limits"]["memory"])


# -- exposure and secrets


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_no_service_is_opened_beyond_the_cluster_and_only_the_gateway_has_an_ingress(
    rendering, rendered
):
    objects = rendered[rendering]
    for service in (o for o in objects if o["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service["metadata"]
    for ingress in (o for o in objects if o["kind"] == "Ingress"):
        backends = {
            path["backend"]["service"]["name"]
            for rule in ingress["spec"]["rules"]
            for path in rule["http"]["paths"]
        }
        assert backends == {"gateway"}
        assert ingress["spec"]["tls"], "an Ingress without TLS"


def test_every_service_gets_the_internal_token_and_the_gateway_its_keys_from_the_secret(
    rendered,
):
    for service, workload in ragblend_workloads(rendered["base"]).items():
        env = {e["name"]: e for e in ragblend_container(workload)["env"]}
        ref = env[f"RAGBLEND_{service.upper()}_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "ragblend-secrets", "key": "internal-token"}
    gateway = ragblend_container(ragblend_workloads(rendered["base"])["gateway"])
    (keys,) = [e for e in gateway["env"] if e["name"] == "RAGBLEND_GATEWAY_API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"]["key"] == "gateway-api-keys"


def test_the_secrets_file_is_ignored_by_git_and_its_example_holds_every_key_and_no_secret(
    rendered,
):
    example = K8S / "base/secrets.env.example"
    pairs = dict(
        line.split("=", 1)
        for line in example.read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert not any(pairs.values()), "secrets.env.example must not hold a secret"
    used = {
        entry["valueFrom"]["secretKeyRef"]["key"]
        for workload in workloads(rendered["base"])
        for container in workload["spec"]["template"]["spec"]["containers"]
        for entry in container.get("env", [])
        if "valueFrom" in entry
    }
    assert used == set(pairs)
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(K8S / "base/secrets.env")], cwd=REPO_ROOT
    )
    assert ignored.returncode == 0, "deploy/k8s/base/secrets.env is not ignored by git"


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_every_pod_runs_as_a_non_root_user_without_privileges_or_an_api_token(rendering, rendered):
    for workload in workloads(rendered[rendering]):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]


# -- state, scaling, GPU


def test_engine_and_retriever_keep_their_state_on_volume_claims_where_the_settings_point(
    rendered, monkeypatch
):
    objects = rendered["base"]
    paths = {
        "engine": lambda s: s.store_path,
        "retriever": lambda s: s.data_dir,
    }
    for service, path_of in paths.items():
        workload = ragblend_workloads(objects)[service]
        assert workload["kind"] == "StatefulSet"
        claims = {c["metadata"]["name"]: c for c in workload["spec"]["volumeClaimTemplates"]}
        mounts = {m["mountPath"]: m["name"] for m in ragblend_container(workload)["volumeMounts"]}
        claim = claims[mounts[str(path_of(settings_of(service, objects, monkeypatch)))]]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    engine = ragblend_workloads(objects)["engine"]
    (claim,) = engine["spec"]["volumeClaimTemplates"]
    size_gib = quantity_gib(claim["spec"]["resources"]["requests"]["storage"])
    assert settings_of("engine", objects, monkeypatch).ssd_budget_gb < size_gib


def test_engine_memory_tiers_and_kv_pool_fit_within_its_memory_limit(rendered, monkeypatch):
    objects = rendered["base"]
    settings = settings_of("engine", objects, monkeypatch)
    assert settings.kv_pool_gb is not None, "on the CPU it would be sized from the node's RAM"
    engine = ragblend_container(ragblend_workloads(objects)["engine"])
    limit_gib = quantity_gib(engine["resources"]["limits"]["memory"])
    assert settings.memory_budget_gb + settings.kv_pool_gb < limit_gib


def test_the_hpa_scales_the_gateway_deployment_on_cpu_and_owns_its_replicas(rendered):
    objects = rendered["base"]
    hpa = find(objects, "HorizontalPodAutoscaler", "gateway")
    target = hpa["spec"]["scaleTargetRef"]
    gateway = find(objects, target["kind"], target["name"])
    assert "replicas" not in gateway["spec"], "a re-apply would reset the HPA's count"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert ragblend_container(gateway)["resources"]["requests"]["cpu"]
    assert hpa["spec"]["minReplicas"] >= 2


def test_the_gpu_overlay_gives_each_engine_a_gpu_cuda_and_a_pool_sized_by_the_device(
    rendered, monkeypatch
):
    base = ragblend_container(ragblend_workloads(rendered["base"])["engine"])
    assert "nvidia.com/gpu" not in base["resources"]["limits"]
    gpu = ragblend_container(ragblend_workloads(rendered["gpu"])["engine"])
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["image"] == "ragblend:cuda"
    settings = settings_of("engine", rendered["gpu"], monkeypatch)
    assert settings.device == "cuda" and settings.kv_pool_gb is None


# -- monitoring


def test_the_dashboard_configmap_holds_the_grafana_dashboard_json(rendered):
    dashboard = find(rendered["base"], "ConfigMap", "ragblend-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (content,) = dashboard["data"].values()
    assert json.loads(content) == json.loads(DASHBOARD.read_text())
    copy = K8S / "base/grafana" / DASHBOARD.name
    assert copy.read_bytes() == DASHBOARD.read_bytes(), (
        f"the copy differs: cp {DASHBOARD.relative_to(REPO_ROOT)} {copy.relative_to(REPO_ROOT)}"
    )


def test_servicemonitors_scrape_each_service_once_by_its_named_port(rendered):
    objects = rendered["all-components"]
    services = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] != "redis"]
    scraped: list[str] = []
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        selector = monitor["spec"]["selector"]
        for service in services:
            labels = service["metadata"]["labels"]
            matches = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
            for expression in selector.get("matchExpressions", []):
                assert expression["operator"] == "In"
                matches = matches and labels.get(expression["key"]) in expression["values"]
            if matches:
                scraped.append(service["metadata"]["name"])
                names = {p["name"] for p in service["spec"]["ports"]}
                for endpoint in monitor["spec"]["endpoints"]:
                    assert endpoint["port"] in names and endpoint["path"] == "/metrics"
    # The job label is the Service's name: what the dashboard and the alerts select on.
    assert sorted(scraped) == sorted(SETTINGS)


def test_the_grafana_datasource_has_the_uid_the_dashboard_uses(rendered):
    source = find(rendered["all-components"], "ConfigMap", "ragblend-grafana-datasource")
    (content,) = source["data"].values()
    (datasource,) = yaml.safe_load(content)["datasources"]
    used = {
        target["datasource"]["uid"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel.get("targets", [])
    }
    assert used == {datasource["uid"]}
