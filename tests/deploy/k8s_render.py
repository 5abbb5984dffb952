"""Renders the kustomize subset that deploy/k8s uses, so the tests build the manifests offline
without kustomize; test_k8s.py checks that `kubectl kustomize` gives the same objects."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import yaml

# Everything else a kustomization may hold is refused, so the subset stays what is rendered.
KUSTOMIZATION_KEYS = frozenset(
    {
        "apiVersion",
        "kind",
        "namespace",
        "resources",
        "components",
        "generatorOptions",
        "configMapGenerator",
        "secretGenerator",
        "patches",
    }
)
GENERATOR_KEYS = frozenset({"name", "files", "envs", "options"})
# Strategic merge: the lists merged element by element, by this key (as Kubernetes' own
# patchMergeKey); the others a patch may hold are replaced whole.
MERGE_KEYS = {"containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath"}
REPLACED_LISTS = frozenset({"args", "command", "tolerations"})
# Kinds that have no namespace (namespace: leaves them alone).
CLUSTER_KINDS = frozenset({"Namespace", "PersistentVolume", "StorageClass", "ClusterRole"})


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature outside the rendered subset."""


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` prints (in no particular order)."""
    return _build(directory, "Kustomization")


def _build(directory: Path, kind: str) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    if unknown:
        raise UnsupportedKustomization(f"{directory}: {sorted(unknown)}")
    if kustomization.get("kind", "Kustomization") != kind:
        raise UnsupportedKustomization(f"{directory} is not a {kind}")
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += _build(path, "Kustomization")
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for entry in kustomization.get("components", []):
        objects = _apply_component(directory / entry, objects)
    objects += _generate(directory, kustomization)
    for patch in kustomization.get("patches", []):
        objects = _apply_patch(directory, patch, objects)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] == "Namespace":
                obj["metadata"]["name"] = namespace  # as kustomize does: the stack moves whole
            elif obj["kind"] not in CLUSTER_KINDS:
                obj["metadata"]["namespace"] = namespace
    _check_unique(objects)
    return objects


def _apply_component(directory: Path, objects: list[dict]) -> list[dict]:
    """A Component's resources added, then its patches applied to everything so far."""
    component = yaml.safe_load((directory / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "resources", "patches"}
    if component.get("kind") != "Component" or set(component) - allowed:
        raise UnsupportedKustomization(f"{directory}: a Component of {sorted(allowed)} only")
    for entry in component.get("resources", []):
        objects += [doc for doc in yaml.safe_load_all((directory / entry).read_text()) if doc]
    for patch in component.get("patches", []):
        objects = _apply_patch(directory, patch, objects)
    return objects


def _generate(directory: Path, kustomization: dict) -> list[dict]:
    generators = kustomization.get("configMapGenerator", []) + kustomization.get(
        "secretGenerator", []
    )
    if not generators:
        return []
    options = kustomization.get("generatorOptions", {})
    if options != {"disableNameSuffixHash": True}:
        raise UnsupportedKustomization("generators need generatorOptions.disableNameSuffixHash")
    objects = []
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for entry in _generator_entries(generator, "files"):
            data[Path(entry).name] = (directory / entry).read_text()
        objects.append(_generated("ConfigMap", generator, {"data": data}))
    for generator in kustomization.get("secretGenerator", []):
        values: dict[str, str] = {}
        for entry in _generator_entries(generator, "envs"):
            values.update(_read_env_file(directory / entry))
        data = {key: base64.b64encode(value.encode()).decode() for key, value in values.items()}
        objects.append(_generated("Secret", generator, {"type": "Opaque", "data": data}))
    return objects


def _generator_entries(generator: dict, field: str) -> list[str]:
    if set(generator) - GENERATOR_KEYS or set(generator) & ({"files", "envs"} - {field}):
        raise UnsupportedKustomization(f"generator {generator.get('name')}: {sorted(generator)}")
    if set(generator.get("options", {})) - {"labels"}:
        raise UnsupportedKustomization(f"generator {generator['name']}: options other than labels")
    return generator.get(field, [])


def _generated(kind: str, generator: dict, body: dict) -> dict:
    metadata: dict = {"name": generator["name"]}
    labels = generator.get("options", {}).get("labels")
    if labels:
        metadata["labels"] = dict(labels)
    return {"apiVersion": "v1", "kind": kind, "metadata": metadata, **body}


def _read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as kustomize reads them: no quoting, # comments and blank lines."""
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise UnsupportedKustomization(f"{path}:{number}: KEY=VALUE expected")
        values[key] = value
    return values


def _apply_patch(directory: Path, patch: dict, objects: list[dict]) -> list[dict]:
    if set(patch) != {"path"}:
        raise UnsupportedKustomization(f"patch {patch}: a strategic-merge file by path only")
    documents = [doc for doc in yaml.safe_load_all((directory / patch["path"]).read_text()) if doc]
    for document in documents:
        matches = [
            i
            for i, obj in enumerate(objects)
            if obj["kind"] == document["kind"]
            and obj["metadata"]["name"] == document["metadata"]["name"]
        ]
        if len(matches) != 1:
            raise UnsupportedKustomization(f"{patch['path']} matches {len(matches)} objects")
        objects[matches[0]] = strategic_merge(objects[matches[0]], document)
    return objects


def strategic_merge(target: dict, patch: dict, field: str = "") -> dict:
    """The target with the patch merged in, as Kubernetes' strategic merge patch does for
    the fields it is used on here: maps merge, null deletes, MERGE_KEYS lists merge by key."""
    result = copy.deepcopy(target)
    for key, value in patch.items():
        if key.startswith("$"):
            raise UnsupportedKustomization(f"{field}.{key}: directives only as `$patch: delete`")
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = strategic_merge(result[key], value, f"{field}.{key}")
        elif isinstance(value, list) and key in MERGE_KEYS and key in result:
            result[key] = _merge_list(result[key], value, MERGE_KEYS[key], f"{field}.{key}")
        elif isinstance(value, list) and key not in MERGE_KEYS.keys() | REPLACED_LISTS:
            raise UnsupportedKustomization(f"{field}.{key}: a list without a known merge rule")
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(target: list[dict], patch: list[dict], merge_key: str, field: str) -> list[dict]:
    """Elements the patch names come first, in its order, then the target's others (the
    order kustomize prints), which matters where a later env var refers to an earlier one."""
    by_key = {element[merge_key]: element for element in target}
    merged = []
    for element in patch:
        key = element[merge_key]
        directive = element.get("$patch")
        if directive == "delete":
            by_key.pop(key, None)
            continue
        if directive is not None:
            raise UnsupportedKustomization(f"{field}: $patch: {directive}")
        merged.append(
            strategic_merge(by_key.pop(key), element, field) if key in by_key else element
        )
    return merged + [element for element in target if element[merge_key] in by_key]


def _check_unique(objects: list[dict]) -> None:
    seen = set()
    for obj in objects:
        ident = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if ident in seen:
            raise UnsupportedKustomization(f"{ident} is defined twice")
        seen.add(ident)
