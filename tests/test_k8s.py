"""The Kubernetes deployment: k8s/ (`kubectl apply -k k8s/`) and its GPU overlay k8s/gpu/.

No cluster needed. The manifests are built as kustomize builds them (a small renderer for what they
use, checked against `kubectl kustomize` where kubectl is installed); every object validates in
strict mode against the OpenAPI schemas that kubernetes-validate bundles, and broken copies do not.
They must agree with the images (docker/*.Dockerfile, via the compose files' image tags), with the
flags the services read and with each other. Then one real run: every pod the controllers would
create, started as a local process as its container would start (the image's ENTRYPOINT and ENV,
the manifest's env with the downward API filled in and $(VAR) expanded), all at once as Kubernetes
starts them; cluster DNS names mapped to 127.0.0.1 and each pod's ports to free local ones. The
coordinator must list both shards and both workers, named after their pods, and every probe pass.
"""

from __future__ import annotations

import base64
import copy
import importlib
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml

from tests.images import BASE as COMPOSE_FILE
from tests.images import (
    CONSOLE_SCRIPTS,
    Image,
    gradps_services,
    load_yaml,
    local_argv,
    merged_compose,
    read_image,
    tool_missing,
)
from tests.services import free_ports

try:
    import kubernetes_validate
except ImportError:  # the test extra installs it; without it, only the validation tests skip
    kubernetes_validate = None

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
GPU = K8S / "gpu"
NAMESPACE = "gradps-test"  # any: the manifests set none and read theirs from the downward API
# The oldest release with GA gRPC probes, and the newest the installed kubernetes-validate knows.
OLDEST_KUBERNETES = "1.27.0"

_STARTUP_TIMEOUT_S = 40.0  # every pod up and joined; about 6 s on an idle 2-core machine
_LOCALHOST = "127.0.0.1"
_ROLES = {"gradps-coordinator": "coordinator", "gradps-shard": "shard", "gradps-worker": "worker"}


# ---------------------------------------------------------------------------------------------
# Building the manifests


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# The lists Kubernetes merges item by item, and the field that names an item.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}
# Lists of strings that a strategic merge replaces whole (the API gives them no merge key).
_REPLACED_LISTS = {"command", "args"}


def _strategic_merge(base, patch, where: str = ""):
    """A strategic-merge patch, for what k8s/gpu/ and k8s/secure/ use: maps merge key by key, a
    null deletes its key, scalars are replaced, and the lists that Kubernetes merges by a key
    (containers, env, volumes by name, volumeMounts by mountPath) merge item by item, the patch's
    items first, as kustomize orders them; an item `$patch: delete` removes its namesake. Anything
    else (another `$patch` directive, another list) would need more of the rules, so it is refused,
    but a container's command and args, which the patch's replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        assert not any(key.startswith("$") for key in patch), f"{where}: patch directives are not supported"
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = (
                    _strategic_merge(base[key], value, f"{where}.{key}") if key in base else copy.deepcopy(value)
                )
        return merged
    if isinstance(base, list) or isinstance(patch, list):
        key = where.rsplit(".", 1)[-1]
        if key in _REPLACED_LISTS:  # no merge strategy in the API: the patch's list replaces the base's
            return copy.deepcopy(patch)
        assert key in _MERGE_KEYS, f"{where}: list not merged by name"
        name = _MERGE_KEYS[key]
        deleted = {p[name] for p in patch if p.get("$patch") == "delete"}
        patch = [p for p in patch if p[name] not in deleted]
        by_name = {item[name]: item for item in base}
        patched = [_strategic_merge(by_name[p[name]], p, where) if p[name] in by_name else p for p in patch]
        names = {p[name] for p in patch} | deleted
        return copy.deepcopy(patched) + [copy.deepcopy(item) for item in base if item[name] not in names]
    return copy.deepcopy(patch)


def _set_image(image: str, rules: list[dict]) -> str:
    name, tag = image.rsplit(":", 1) if ":" in image.rsplit("/", 1)[-1] else (image, "")  # a registry may have a port
    for rule in rules:
        assert set(rule) <= {"name", "newName", "newTag"}, rule
        if rule["name"] == name:
            name, tag = rule.get("newName", name), rule.get("newTag", tag)
    return f"{name}:{tag}" if tag else name


def _key(obj: dict) -> tuple[str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def _generated_secret(directory: Path, generator: dict) -> dict:
    """The Secret of a secretGenerator, for what k8s/secure/ uses: files (`key=path`), no name hash.
    FileNotFoundError where a file is missing, as kustomize fails then."""
    assert set(generator) <= {"name", "type", "files", "options"}, f"{directory}: a secretGenerator {generator}"
    assert generator.get("options") == {"disableNameSuffixHash": True}, "the renderer adds no name hash"
    data = {}
    for entry in generator["files"]:
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = base64.b64encode((directory / path).read_bytes()).decode()
    metadata = {"name": generator["name"]}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": generator.get("type", "Opaque"),
        "data": data,
    }


def _render(directory: Path) -> list[dict]:
    """`kustomize build directory` for the fields k8s/ uses: resources (manifest files or
    kustomization folders), secretGenerator (files), patches (strategic merge, naming their
    object) and images."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization", directory
    unsupported = set(kustomization) - {"apiVersion", "kind", "resources", "secretGenerator", "patches", "images"}
    assert not unsupported, f"{directory}: the test's renderer does not do {unsupported}"
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        objects += _render(path) if path.is_dir() else _documents(path)
    objects += [_generated_secret(directory, g) for g in kustomization.get("secretGenerator", [])]
    for patch in kustomization.get("patches", []):
        assert set(patch) <= {"patch", "path"}, f"{directory}: a patch with {set(patch)}"
        doc = (
            yaml.safe_load(patch["patch"])
            if "patch" in patch
            else yaml.safe_load((directory / patch["path"]).read_text())
        )
        (index,) = [i for i, obj in enumerate(objects) if _key(obj) == _key(doc)]
        objects[index] = _strategic_merge(objects[index], doc)
    for obj in objects:
        spec = _pod_spec(obj) or {}
        for container in spec.get("containers", []):
            container["image"] = _set_image(container["image"], kustomization.get("images", []))
    return objects


def _pod_spec(obj: dict) -> dict | None:
    return obj["spec"]["template"]["spec"] if obj["kind"] in ("Deployment", "StatefulSet") else None


def _workloads(objects: list[dict]) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects if _pod_spec(obj) is not None}


def _services(objects: list[dict]) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Service"}


def _container(workload: dict) -> dict:
    (container,) = _pod_spec(workload)["containers"]
    return container


def _dockerfiles() -> dict[str, Path]:
    """Image tag -> the Dockerfile that builds it, as docker-compose.yml and its GPU override say."""
    out = {}
    for compose in (load_yaml(COMPOSE_FILE), merged_compose()):
        for service in gradps_services(compose).values():
            out[service["image"]] = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
    return out


def _image(container: dict) -> Image:
    dockerfiles = _dockerfiles()
    assert container["image"] in dockerfiles, f"{container['image']} is no image that compose builds"
    return read_image(dockerfiles[container["image"]])


# ---------------------------------------------------------------------------------------------
# Validation


def _validator():
    if kubernetes_validate is None:
        tool_missing("kubernetes-validate", "pip install kubernetes-validate")
    return kubernetes_validate


def _validate(obj: dict, version: str) -> None:
    """Raises kubernetes_validate.ValidationError (or SchemaNotFoundError for an unknown kind)."""
    _validator().validate(obj, version, strict=True)


def _versions() -> list[str]:
    return [OLDEST_KUBERNETES, kubernetes_validate.latest_version() if kubernetes_validate else "latest"]


@pytest.mark.parametrize("version", _versions())
@pytest.mark.parametrize("build", [K8S, GPU], ids=["base", "gpu"])
def test_every_object_validates_strictly(build: Path, version: str):
    validator = _validator()
    for obj in _render(build):
        try:
            _validate(obj, version)
        except validator.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on Kubernetes {version}: {e.message}")


# Each breaks a manifest in one way the API server would reject.
_BROKEN = {
    "misspelt field": (
        "base/coordinator.yaml",
        "      terminationGracePeriodSeconds:",
        "      terminationGracePeriod:",
    ),
    "string for an int": ("base/shard.yaml", "  replicas: 2", '  replicas: "2"'),
    "named port in a grpc probe": (
        "base/shard.yaml",
        "startupProbe:\n            grpc:\n              port: 50052",
        "startupProbe:\n            grpc:\n              port: grpc",
    ),
    "unknown apiVersion": ("base/shard.yaml", "apiVersion: apps/v1\n", "apiVersion: apps/v1beta2\n"),
    "field at the wrong level": (
        "base/worker.yaml",
        "    spec:\n      enable",
        "    spec:\n      image: gradps-worker:local\n      enable",
    ),
}


@pytest.mark.parametrize("broken", sorted(_BROKEN))
def test_validation_rejects_a_broken_copy(broken: str):
    validator = _validator()
    path, old, new = _BROKEN[broken]
    text = (K8S / path).read_text()
    assert text.count(old) == 1, f"{broken}: {old!r} no longer occurs once in k8s/{path}; update _BROKEN"
    errors = []
    for obj in (doc for doc in yaml.safe_load_all(text.replace(old, new)) if doc):
        try:
            _validate(obj, validator.latest_version())
        except (validator.ValidationError, validator.SchemaNotFoundError) as e:
            errors.append(e)
    assert errors, f"a manifest with a {broken} validated"


def test_the_renderer_builds_what_kustomize_builds():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found; the renderer is compared with `kubectl kustomize` where it is")
    for build in (K8S, GPU):
        result = subprocess.run([kubectl, "kustomize", str(build)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert sorted(_documents_of(result.stdout), key=_key) == sorted(_render(build), key=_key), build


def _documents_of(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


# ---------------------------------------------------------------------------------------------
# Consistency


def test_the_base_is_a_coordinator_two_shards_and_two_workers():
    base = K8S / "base"
    listed = yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in base.glob("*.yaml") if p.name != "kustomization.yaml")
    objects = _render(K8S)
    assert len({_key(obj) for obj in objects}) == len(objects), "an object defined twice"
    workloads = _workloads(objects)
    assert {name: (w["kind"], w["spec"]["replicas"]) for name, w in workloads.items()} == {
        "gradps-coordinator": ("Deployment", 1),
        "gradps-shard": ("StatefulSet", 2),
        "gradps-worker": ("Deployment", 2),
    }
    assert workloads["gradps-coordinator"]["spec"]["strategy"]["type"] == "Recreate", "never two coordinators"
    assert set(_services(objects)) == {"gradps-coordinator", "gradps-shard"}
    assert all("namespace" not in obj["metadata"] for obj in objects), "kubectl -n chooses the namespace"


@pytest.mark.parametrize("build", [K8S, GPU], ids=["base", "gpu"])
def test_each_pod_runs_its_service_from_its_image(build: Path):
    for name, workload in _workloads(_render(build)).items():
        container = _container(workload)
        image = _image(container)
        argv = container.get("command") or image.entrypoint  # command replaces the ENTRYPOINT
        assert argv[0] in CONSOLE_SCRIPTS and argv[0] == name, f"{name} runs {argv}"
        assert not container.get("args"), f"{name}: configure through GRADPS_* env, as compose does"
        assert workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == _ROLES[name]


def _envvars(program: str) -> set[str]:
    """The environment variables a service's click command reads."""
    module, function = CONSOLE_SCRIPTS[program].split(":")
    command = getattr(importlib.import_module(module), function)
    names: set[str] = set()
    for param in command.params:
        envvar = getattr(param, "envvar", None)
        names.update([envvar] if isinstance(envvar, str) else envvar or [])
    return names


_DOWNWARD_API = {"metadata.name", "metadata.namespace"}


@pytest.mark.parametrize("build", [K8S, GPU], ids=["base", "gpu"])
def test_every_variable_is_one_the_service_reads(build: Path):
    for name, workload in _workloads(_render(build)).items():
        container = _container(workload)
        reads = _envvars(name)
        assert _pod_spec(workload)["enableServiceLinks"] is False, f"{name}: service links inject GRADPS_* names"
        env = container.get("env", [])
        assert len({e["name"] for e in env}) == len(env), f"{name}: a variable set twice"
        for i, entry in enumerate(env):
            if entry["name"].startswith("GRADPS_"):
                assert entry["name"] in reads, f"{name} does not read {entry['name']} (it reads {sorted(reads)})"
            else:  # a helper: filled by the downward API and used by a later $(VAR)
                assert entry["valueFrom"]["fieldRef"]["fieldPath"] in _DOWNWARD_API, (name, entry)
                later = " ".join(e.get("value", "") for e in env[i + 1 :])
                assert f"$({entry['name']})" in later, f"{name}: {entry['name']} is not used after it is set"
            if "valueFrom" in entry:
                assert set(entry["valueFrom"]) == {"fieldRef"}, (name, entry)


def _port_of(workload: dict) -> int | None:
    """The port the service binds: GRADPS_PORT of the manifest, else of the image."""
    container = _container(workload)
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    port = env.get("GRADPS_PORT", _image(container).env.get("GRADPS_PORT"))
    return int(port) if port else None


def _data_ports(workload: dict) -> list[int]:
    """A shard's data port (GRADPS_DATA_PORT of the manifest, else of the image), if it has one."""
    container = _container(workload)
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    port = env.get("GRADPS_DATA_PORT", _image(container).env.get("GRADPS_DATA_PORT"))
    return [int(port)] if port else []


def _probes(container: dict) -> dict[str, dict]:
    return {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container}


@pytest.mark.parametrize("build", [K8S, GPU], ids=["base", "gpu"])
def test_ports_probes_and_services_agree(build: Path):
    objects = _render(build)
    workloads = _workloads(objects)
    for name, workload in workloads.items():
        container, port = _container(workload), _port_of(workload)
        image = _image(container)
        assert _probes(container).keys() == {"startupProbe", "readinessProbe", "livenessProbe"}, name
        if port is None:  # a worker: no port; probed the way its image's HEALTHCHECK is
            assert "ports" not in container and image.expose == [], name
            for kind, probe in _probes(container).items():
                assert probe["exec"]["command"] == image.healthcheck == ["gradps-healthcheck", "worker"], (name, kind)
                assert probe["exec"]["command"][0] in image.copied_executables
        else:
            ports = [port, *_data_ports(workload)]
            assert [p["containerPort"] for p in container["ports"]] == ports, name
            assert image.expose == [str(p) for p in ports], f"{name}: the image EXPOSEs {image.expose}"
            for kind, probe in _probes(container).items():
                assert probe["grpc"] == {"port": port}, f"{name}'s {kind} checks {probe['grpc']}, not the server"
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), name

    for service in _services(objects).values():
        selector = service["spec"]["selector"].items()
        selected = [w for w in workloads.values() if selector <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"Service {service['metadata']['name']} selects {len(selected)} workloads"
        for entry in service["spec"]["ports"]:
            assert _target_port(selected[0], entry) == _port_of(selected[0]) == entry["port"], entry
    shards = workloads["gradps-shard"]
    headless = _services(objects)[shards["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None", "a StatefulSet's own DNS names come from a headless Service"


def _target_port(workload: dict, service_port: dict) -> int:
    target = service_port.get("targetPort", service_port["port"])
    if isinstance(target, int):
        return target
    (port,) = [p["containerPort"] for p in _container(workload).get("ports", []) if p.get("name") == target]
    return port


@pytest.mark.parametrize("build", [K8S, GPU], ids=["base", "gpu"])
def test_addresses_name_a_service_and_its_port_and_shards_their_own_dns_name(build: Path):
    objects = _render(build)
    network = Network(objects, _pods(objects))
    found = 0
    for pod in network.pods:
        for key, value in pod.env.items():
            if re.fullmatch(r"[\w.-]+:\d+", value):
                host, port = value.rsplit(":", 1)
                assert host in _services(objects), f"{pod.name}: {key}={value} names no Service"
                network.dial(host, int(port))  # raises unless the Service has that port
                found += 1
        if "GRADPS_ADVERTISE_HOST" in pod.env:
            host = pod.env["GRADPS_ADVERTISE_HOST"]
            assert network.resolve(host) == [pod], f"{pod.name} advertises {host}, which is not its own name"
    assert found == 4, "each shard and worker names the coordinator"


@pytest.mark.parametrize("build", [K8S, GPU], ids=["base", "gpu"])
def test_pods_run_as_their_images_user_with_resources_and_a_grace_period(build: Path):
    for name, workload in _workloads(_render(build)).items():
        spec, container = _pod_spec(workload), _container(workload)
        uid, gid = _image(container).user.split(":")
        assert spec["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": int(uid),
            "runAsGroup": int(gid),
            "seccompProfile": {"type": "RuntimeDefault"},
        }, name
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), name
        assert "cpu" not in container["resources"].get("limits", {}), f"{name}: a CPU limit throttles training"
        assert spec["terminationGracePeriodSeconds"] >= 5, f"{name}: time to stop the gRPC server (2 s grace)"
        assert spec["automountServiceAccountToken"] is False, name


def test_gpu_overlay_swaps_images_device_and_gpus_only():
    base, gpu = _workloads(_render(K8S)), _workloads(_render(GPU))
    compose_gpu = merged_compose()["services"]
    assert gpu["gradps-coordinator"] == base["gradps-coordinator"], "the coordinator needs no GPU"
    for name, compose_name in (("gradps-shard", "shard-0"), ("gradps-worker", "worker-0")):
        container = _container(gpu[name])
        assert container["image"] == compose_gpu[compose_name]["image"], "the image of docker-compose.gpu.yml"
        assert _dockerfiles()[container["image"]].name.endswith(".cuda.Dockerfile")
        env = {e["name"]: e for e in container["env"]}
        assert env["GRADPS_DEVICE"]["value"] == "cuda"
        for kind in ("requests", "limits"):
            assert container["resources"][kind]["nvidia.com/gpu"] == 1, (name, kind)
        # Undo exactly those changes, and the base is back.
        undone = copy.deepcopy(gpu[name])
        back = _container(undone)
        back["image"] = _container(base[name])["image"]
        for kind in ("requests", "limits"):
            del back["resources"][kind]["nvidia.com/gpu"]
        back["env"] = [e if e["name"] != "GRADPS_DEVICE" else {**e, "value": "cpu"} for e in back["env"]]
        order = [e["name"] for e in _container(base[name])["env"]]
        back["env"].sort(key=lambda e: order.index(e["name"]))
        assert undone == base[name], f"{name}: the overlay changes more than image, device and GPUs"


# ---------------------------------------------------------------------------------------------
# The pods as local processes


_K8S_EXPANSION = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: variables defined earlier; `$$` is `$`; unknown ones stay."""

    def one(match: re.Match) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _K8S_EXPANSION.sub(one, value)


@dataclass
class Pod:
    """One pod as its controller would create it, and what its container sees."""

    name: str
    workload: dict
    container: dict
    image: Image
    env: dict[str, str]  # the image's GRADPS_* ENV, then the manifest's env, as the container sees it

    @property
    def argv(self) -> list[str]:
        """The manifest's command (else the image's ENTRYPOINT) and args; only the manifest's expand."""
        command = [_expand(a, self.env) for a in self.container.get("command", [])] or self.image.entrypoint
        return [*command, *(_expand(a, self.env) for a in self.container.get("args", []))]

    @property
    def ports(self) -> list[int]:
        return [p["containerPort"] for p in self.container.get("ports", [])]


def _pod_names(workload: dict) -> list[str]:
    """StatefulSets number their pods; Deployments add the pod-template hash and five random characters."""
    name, replicas = workload["metadata"]["name"], workload["spec"]["replicas"]
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(replicas)]
    rng = random.Random(name)
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # Kubernetes' random suffixes avoid vowels
    template_hash = "".join(rng.choices(alphabet, k=10))
    return [f"{name}-{template_hash}-{''.join(rng.choices(alphabet, k=5))}" for _ in range(replicas)]


def _pods(objects: list[dict]) -> list[Pod]:
    pods = []
    for workload in _workloads(objects).values():
        container = _container(workload)
        image = _image(container)
        for pod_name in _pod_names(workload):
            fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE}
            env = {k: v for k, v in image.env.items() if k.startswith("GRADPS_")}
            for entry in container.get("env", []):
                if "valueFrom" in entry:
                    env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
                else:
                    env[entry["name"]] = _expand(entry.get("value", ""), env)
                assert "$(" not in env[entry["name"]], f"{pod_name}: {entry['name']} has an undefined $(VAR)"
            pods.append(Pod(pod_name, workload, container, image, env))
    return pods


@dataclass
class Network:
    """Cluster DNS and Services on 127.0.0.1. In the cluster each pod has its own IP and the shards
    all bind 50052; here each pod's container port becomes a distinct free local port."""

    objects: list[dict]
    pods: list[Pod]
    local: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self):
        wanted = [(pod.name, port) for pod in self.pods for port in pod.ports]
        self.local = dict(zip(wanted, free_ports(len(wanted)), strict=True))

    def _selected(self, service: dict) -> list[Pod]:
        selector = service["spec"]["selector"].items()
        return [p for p in self.pods if selector <= p.workload["spec"]["template"]["metadata"]["labels"].items()]

    def resolve(self, host: str) -> list[Pod]:
        """The pods a name in the pod's namespace resolves to: a Service's (`svc`, `svc.ns`,
        `svc.ns.svc`, `svc.ns.svc.cluster.local`), or one pod of a StatefulSet (`pod.svc.ns.svc`)
        through the StatefulSet's headless Service."""
        for suffix in (f".{NAMESPACE}.svc.cluster.local", f".{NAMESPACE}.svc", f".{NAMESPACE}", ""):
            if host.endswith(suffix):
                name = host.removesuffix(suffix) if suffix else host
                services = _services(self.objects)
                if name in services:
                    return self._selected(services[name])
                pod_name, _, service_name = name.partition(".")
                if service_name in services and services[service_name]["spec"].get("clusterIP") == "None":
                    return [
                        p
                        for p in self._selected(services[service_name])
                        if p.name == pod_name and p.workload["spec"].get("serviceName") == service_name
                    ]
        return []

    def dial(self, host: str, port: int) -> str:
        """The local address that `host:port` reaches."""
        pods = self.resolve(host)
        assert len(pods) == 1, f"{host} resolves to {len(pods)} pods"
        services = _services(self.objects)
        name = host.split(".")[0]
        if name in services:  # through the Service: its port -> the pod's target port
            entries = [e for e in services[name]["spec"]["ports"] if e["port"] == port]
            assert len(entries) == 1, f"{host}:{port}: Service {name} has no port {port}"
            (entry,) = entries
            port = _target_port(pods[0].workload, entry)
        assert (pods[0].name, port) in self.local, f"{host}:{port}: {pods[0].name} has no port {port}"
        return f"{_LOCALHOST}:{self.local[pods[0].name, port]}"

    def local_env(self, pod: Pod) -> dict[str, str]:
        """The pod's environment on this machine."""
        env = {}
        for key, value in pod.env.items():
            if key in ("GRADPS_PORT", "GRADPS_DATA_PORT"):
                env[key] = str(self.local[pod.name, int(value)])
            elif key in ("GRADPS_METRICS_PORT", "GRADPS_METRICS_HOST"):  # any free port, on loopback
                env[key] = "0" if key.endswith("PORT") else _LOCALHOST
            elif re.fullmatch(r"[\w.-]+:\d+", value) and self.resolve(value.rsplit(":", 1)[0]):
                host, port = value.rsplit(":", 1)
                env[key] = self.dial(host, int(port))
            elif key.endswith("_HOST") and self.resolve(value):
                env[key] = _LOCALHOST
            else:
                env[key] = value
        return env


class LocalPods:
    """The pods as local processes: started together, stopped together, as Kubernetes does."""

    def __init__(self, network: Network, logs: Path):
        self.network = network
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.deadline = time.monotonic() + _STARTUP_TIMEOUT_S

    def environ(self, pod: Pod) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPS_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env |= self.network.local_env(pod)
        if "GRADPS_STATE_DIR" in env:  # the pod's volume: a folder of this test's, not the host's
            env["GRADPS_STATE_DIR"] = str(self.logs / f"{pod.name}-state")
        return env

    def start(self) -> None:
        for pod in self.network.pods:
            with open(self.logs / f"{pod.name}.log", "wb") as log:
                self.procs[pod.name] = subprocess.Popen(
                    local_argv(pod.argv, pod.image.copied_executables),
                    env=self.environ(pod),
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def logs_tail(self, lines: int = 25) -> str:
        out = []
        for name, proc in self.procs.items():
            text = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]
            out.append(f"----- {name} (exit {proc.poll()})\n" + "\n".join(text))
        return "\n".join(out)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}\n{self.logs_tail()}"

    def remaining(self, what: str) -> None:
        assert time.monotonic() < self.deadline, f"timed out waiting for {what}\n{self.logs_tail()}"

    def probe(self, pod: Pod, probe: dict) -> str | None:
        """What the kubelet's probe sees: None when it passes, else why not."""
        timeout = probe.get("timeoutSeconds", 1)
        if "grpc" in probe:
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            address = f"{_LOCALHOST}:{self.network.local[pod.name, probe['grpc']['port']]}"
            request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
            try:
                with grpc.insecure_channel(address) as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
            except grpc.RpcError as e:
                return f"{e.code().name}: {e.details()}"
            return None if reply.status == health_pb2.HealthCheckResponse.SERVING else str(reply.status)
        argv = local_argv(probe["exec"]["command"], pod.image.copied_executables)
        result = subprocess.run(argv, env=self.environ(pod), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        return None if result.returncode == 0 else f"exit {result.returncode}: {result.stderr.strip()}"

    def stop(self) -> dict[str, int | None]:
        """SIGTERM to every pod at once, SIGKILL after its terminationGracePeriodSeconds; exit codes,
        None where the grace period ran out."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        began, codes = time.monotonic(), {}
        for pod in self.network.pods:
            if pod.name not in self.procs:
                continue
            proc = self.procs[pod.name]
            grace = pod.workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            try:
                codes[pod.name] = proc.wait(timeout=max(0.0, began + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                codes[pod.name] = None
        return codes


@pytest.mark.timeout(120)
def test_the_pods_form_a_cluster_as_local_processes(tmp_path: Path):
    from gradps.v1 import coordinator_pb2, coordinator_pb2_grpc

    objects = _render(K8S)
    pods = LocalPods(Network(objects, _pods(objects)), tmp_path)
    network = pods.network
    by_role = {
        role: [p for p in network.pods if _ROLES[p.workload["metadata"]["name"]] == role] for role in _ROLES.values()
    }
    assert [len(by_role[r]) for r in ("coordinator", "shard", "worker")] == [1, 2, 2]
    coordinator = network.dial("gradps-coordinator", 50051)
    try:
        pods.start()
        expected_shards = sorted(f"{_LOCALHOST}:{network.local[p.name, p.ports[0]]}" for p in by_role["shard"])
        expected_workers = sorted(p.name for p in by_role["worker"])
        with grpc.insecure_channel(coordinator) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            while True:
                pods.check_alive()
                try:
                    reply = stub.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=5)
                    shards, live = sorted(reply.shards), sorted(w.name for w in reply.workers if w.alive)
                except grpc.RpcError as e:  # the coordinator is still importing torch
                    shards, live = [], [e.code().name]
                if shards == expected_shards and live == expected_workers:
                    break
                pods.remaining(f"2 shards and 2 workers; the coordinator has {shards}, {live}")
                time.sleep(0.25)
        for pod in network.pods:  # every probe passes on the running cluster
            for kind, probe in _probes(pod.container).items():
                problem = pods.probe(pod, probe)
                assert problem is None, f"{pod.name}'s {kind} fails: {problem}\n{pods.logs_tail()}"
    finally:
        codes = pods.stop()
    assert all(code is not None for code in codes.values()), f"killed after the grace period: {codes}"
    assert codes == dict.fromkeys(codes, 0), f"exit codes after SIGTERM: {codes}\n{pods.logs_tail()}"


def test_the_monitoring_build_is_the_base_plus_a_service_monitor_of_every_pod():
    objects = _render(K8S / "monitoring")
    base = _render(K8S)
    added = [obj for obj in objects if obj not in base]
    assert [o for o in objects if o in base] == base, "the monitoring build changes the base"
    assert sorted(o["kind"] for o in added) == ["Service", "ServiceMonitor"]
    (service,) = [o for o in added if o["kind"] == "Service"]
    (monitor,) = [o for o in added if o["kind"] == "ServiceMonitor"]
    for version in _versions():
        _validate(service, version)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"

    # The Service selects every pod, at the port each serves its metrics on.
    selector = service["spec"]["selector"].items()
    workloads = _workloads(base)
    for name, workload in workloads.items():
        assert selector <= workload["spec"]["template"]["metadata"]["labels"].items(), f"{name} is not scraped"
        env = {e["name"]: e.get("value") for e in _container(workload)["env"]}
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == int(env["GRADPS_METRICS_PORT"]), name
    assert service["spec"]["clusterIP"] == "None", "headless: its endpoints are the pods themselves"

    # The ServiceMonitor selects that Service alone, by a port it names.
    chosen = monitor["spec"]["selector"]["matchLabels"].items()
    matching = [s for s in _services(objects).values() if chosen <= s["metadata"]["labels"].items()]
    assert matching == [service]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"


# ---------------------------------------------------------------------------------------------
# NetworkPolicies (k8s/base/network-policies.yaml): who may reach which port of which pod


SECURE = K8S / "secure"
# The peers a policy must tell apart: each gradps role, a CLI pod as network-policies.yaml labels
# it, Prometheus as it documents it, and pods that must not get in.
_CLIENT_LABELS = {"app.kubernetes.io/name": "gradps", "app.kubernetes.io/component": "client"}
_PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
_STRANGERS = {
    "another pod of the namespace": (NAMESPACE, {"app.kubernetes.io/name": "other"}),
    "another pod of monitoring": ("monitoring", {"app.kubernetes.io/name": "grafana"}),
    "a prometheus elsewhere": ("default", {"app.kubernetes.io/name": "prometheus"}),
}


def _role(pod: Pod) -> str:
    return _ROLES[pod.workload["metadata"]["name"]]


def _peers(pods: list[Pod]) -> dict[str, tuple[str, dict[str, str]]]:
    """Peer name -> (namespace, pod labels)."""
    peers = {_role(p): (NAMESPACE, p.workload["spec"]["template"]["metadata"]["labels"]) for p in pods}
    return peers | {"client": (NAMESPACE, _CLIENT_LABELS), "prometheus": _PROMETHEUS} | _STRANGERS


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is checked here: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_admitted(entry: dict, namespace: str, labels: dict[str, str]) -> bool:
    """One `from` entry: podSelector alone means the policy's namespace; both selectors must match."""
    assert set(entry) <= {"podSelector", "namespaceSelector"}, f"ipBlock and others are not checked: {entry}"
    if "namespaceSelector" in entry:
        in_namespace = _selects(entry["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
    else:
        in_namespace = namespace == NAMESPACE
    return in_namespace and _selects(entry.get("podSelector", {}), labels)


def _port_admitted(entry: dict, port: int, pod: Pod) -> bool:
    assert entry.get("protocol", "TCP") == "TCP" and "endPort" not in entry, entry
    named = {p.get("name"): p["containerPort"] for p in pod.container.get("ports", [])}
    return (named.get(entry["port"]) if isinstance(entry["port"], str) else entry["port"]) == port


def _admitted(policies: list[dict], peer: tuple[str, dict[str, str]], pod: Pod, port: int) -> bool:
    """Whether a TCP connection from `peer` to `pod`'s `port` gets through (NetworkPolicy's rules:
    a pod no policy selects takes everything; a selected one what any of its rules allow)."""
    labels = pod.workload["spec"]["template"]["metadata"]["labels"]
    selecting = [
        p for p in policies if _selects(p["spec"]["podSelector"], labels) and "Ingress" in p["spec"]["policyTypes"]
    ]
    assert selecting, f"{pod.name}: no NetworkPolicy selects it, so anything reaches it"
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers is not None and not any(_peer_admitted(e, *peer) for e in peers):
                continue
            if "ports" not in rule or any(_port_admitted(e, port, pod) for e in rule["ports"]):
                return True
    return False


def _listening(pod: Pod) -> list[int]:
    """Every port the pod's service listens on: GRADPS_PORT, GRADPS_DATA_PORT, GRADPS_METRICS_PORT."""
    names = ("GRADPS_PORT", "GRADPS_DATA_PORT", "GRADPS_METRICS_PORT")
    return [int(pod.env[n]) for n in names if pod.env.get(n)]


def _calls(objects: list[dict]) -> set[tuple[str, str, int]]:
    """(caller, callee, port) of every connection the services make, from the manifests: each
    address a pod's env names (host:port of a Service), the shards' advertised addresses (placement
    hands them to the workers, gRPC and data port; the coordinator calls their gRPC port), the CLI
    to the coordinator's Service, Prometheus to every pod's metrics port."""
    network = Network(objects, _pods(objects))
    services = _services(objects)
    calls = set()
    for pod in network.pods:
        for key, value in pod.env.items():
            if re.fullmatch(r"[\w.-]+:\d+", value) and network.resolve(value.rsplit(":", 1)[0]):
                host, port = value.rsplit(":", 1)
                (entry,) = [e for e in services[host]["spec"]["ports"] if e["port"] == int(port)]
                for target in network.resolve(host):
                    callers = [_role(pod), "client"] if key == "GRADPS_COORDINATOR" else [_role(pod)]
                    calls |= {(c, _role(target), _target_port(target.workload, entry)) for c in callers}
        if "GRADPS_ADVERTISE_HOST" in pod.env:
            assert network.resolve(pod.env["GRADPS_ADVERTISE_HOST"]) == [pod]
            grpc_port = int(pod.env["GRADPS_PORT"])
            calls |= {("worker", _role(pod), p) for p in [grpc_port, *_data_ports(pod.workload)]}
            calls.add(("coordinator", _role(pod), grpc_port))
        calls.add(("prometheus", _role(pod), int(pod.env["GRADPS_METRICS_PORT"])))
    return calls


def _admitted_calls(objects: list[dict]) -> set[tuple[str, str, int]]:
    pods = _pods(objects)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    ports = sorted({port for pod in pods for port in [*_listening(pod), *pod.ports]})
    return {
        (name, _role(pod), port)
        for name, peer in _peers(pods).items()
        for pod in pods
        for port in ports
        if _admitted(policies, peer, pod, port)
    }


@pytest.mark.parametrize("build", [K8S, GPU, K8S / "monitoring"], ids=["base", "gpu", "monitoring"])
def test_network_policies_admit_exactly_the_calls_the_services_make(build: Path):
    objects = _render(build)
    calls = _calls(objects)
    assert {c[:2] for c in calls} == {
        ("worker", "coordinator"),
        ("shard", "coordinator"),
        ("client", "coordinator"),
        ("worker", "shard"),
        ("coordinator", "shard"),
        ("prometheus", "coordinator"),
        ("prometheus", "shard"),
        ("prometheus", "worker"),
    }, "the services call each other differently now: update network-policies.yaml and this list"
    admitted = _admitted_calls(objects)
    assert admitted - calls == set(), "admitted, though no service makes these calls"
    assert calls - admitted == set(), "calls the services make, refused"
    for pod in _pods(objects):  # every port a service listens on is reached by someone
        assert {c[2] for c in calls if c[1] == _role(pod)} == set(_listening(pod)), pod.name


# Each widens or narrows k8s/base/network-policies.yaml in one way the check above must notice.
_LOOSER = {
    "any pod to the shards": ("gradps-shard", lambda spec: spec["ingress"][0].pop("from")),
    "any port of the coordinator": ("gradps-coordinator", lambda spec: spec["ingress"][0].pop("ports")),
    "no data port": ("gradps-shard", lambda spec: spec["ingress"][0]["ports"].pop()),
    "metrics from any namespace": (
        "gradps-metrics",
        lambda spec: spec["ingress"][0]["from"][0].pop("namespaceSelector"),
    ),
    "allow all in the default deny": ("gradps-default-deny", lambda spec: spec.update(ingress=[{}])),
}


@pytest.mark.parametrize("change", sorted(_LOOSER))
def test_the_network_policy_check_sees_a_changed_policy(change: str):
    objects = _render(K8S)
    name, edit = _LOOSER[change]
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == name]
    edit(policy["spec"])
    assert _admitted_calls(objects) != _calls(objects), f"{change} went unnoticed"


# ---------------------------------------------------------------------------------------------
# The secure overlay: k8s/secure/ (tokens, TLS, probes that speak it) and its cert-manager example


CERT_MANAGER = SECURE / "cert-manager.yaml"
_SECRET_FILES = ("cluster-secret", "worker-token")  # what its secretGenerator reads; never in git
# The variables that name a file a service reads its secret, token or TLS material from.
_FILE_VARS = ("GRADPS_SECRET_FILE", "GRADPS_TOKEN_FILE", "GRADPS_TLS_CERT", "GRADPS_TLS_KEY", "GRADPS_TLS_CA")


def _gradps(*args: str, env: dict[str, str] | None = None) -> str:
    """The `gradps` CLI's output, run as the image would run it, with no GRADPS_* of this process."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GRADPS_")} | (env or {})
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    argv = local_argv(["gradps", *args], {})
    result = subprocess.run(argv, env=environ, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"gradps {' '.join(args)}: {result.stderr}"
    return result.stdout.strip()


@dataclass(frozen=True)
class SecureBuild:
    """k8s/secure/ built from a copy of k8s/ with its secret files made."""

    folder: Path
    secret: str
    objects: list[dict]


@pytest.fixture(scope="module")
def secure_build(tmp_path_factory: pytest.TempPathFactory) -> SecureBuild:
    """The files k8s/secure/kustomization.yaml asks for, made as it says: a random cluster secret,
    and the worker token that `gradps token worker` derives from it."""
    root = tmp_path_factory.mktemp("secure") / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns(*_SECRET_FILES))
    folder = root / "secure"
    secret = secrets.token_urlsafe(32)
    (folder / "cluster-secret").write_text(secret + "\n")
    token = _gradps("token", "worker", env={"GRADPS_SECRET_FILE": str(folder / "cluster-secret")})
    (folder / "worker-token").write_text(token + "\n")
    return SecureBuild(folder, secret, _render(folder))


def _cert_manager() -> list[dict]:
    return _documents(CERT_MANAGER)


def _serving_certificate() -> dict:
    (serving,) = [o for o in _cert_manager() if o["kind"] == "Certificate" and not o["spec"].get("isCA")]
    return serving


def _generated(objects: list[dict]) -> dict[str, dict[str, bytes]]:
    """The build's Secrets: name -> key -> content."""
    return {
        o["metadata"]["name"]: {k: base64.b64decode(v) for k, v in o["data"].items()}
        for o in objects
        if o["kind"] == "Secret"
    }


def _mounted(workload: dict, path: str) -> tuple[str, str]:
    """The Secret and key whose file `path` is in the workload's container."""
    spec, container = _pod_spec(workload), _container(workload)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    (mount,) = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True, f"{mount}: a service has no business writing its secrets"
    secret = volumes[mount["name"]]["secret"]
    relative = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    if "items" not in secret:
        return secret["secretName"], relative
    (key,) = [item["key"] for item in secret["items"] if item["path"] == relative]
    return secret["secretName"], key


def test_the_secure_build_needs_its_secret_files(tmp_path: Path):
    copied = tmp_path / "k8s"
    shutil.copytree(K8S, copied, ignore=shutil.ignore_patterns(*_SECRET_FILES))
    with pytest.raises(FileNotFoundError):  # no placeholder to deploy by mistake
        _render(copied / "secure")
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        result = subprocess.run([kubectl, "kustomize", str(copied / "secure")], capture_output=True, timeout=60)
        assert result.returncode != 0, "kustomize builds k8s/secure/ without its secret files"
    generators = yaml.safe_load((SECURE / "kustomization.yaml").read_text())["secretGenerator"]
    assert sorted(f.split("=")[-1] for g in generators for f in g["files"]) == sorted(_SECRET_FILES)
    assert set(_SECRET_FILES) <= set((SECURE / ".gitignore").read_text().split()), "keep them out of git"


@pytest.mark.parametrize("version", _versions())
def test_the_secure_build_validates_strictly(secure_build: SecureBuild, version: str):
    validator = _validator()
    for obj in secure_build.objects:
        try:
            _validate(obj, version)
        except validator.ValidationError as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on Kubernetes {version}: {e.message}")
    assert "GRADPS_INSECURE" not in yaml.safe_dump_all(secure_build.objects)


def test_the_renderer_builds_what_kustomize_builds_of_the_secure_overlay(secure_build: SecureBuild):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found; the renderer is compared with `kubectl kustomize` where it is")
    result = subprocess.run(
        [kubectl, "kustomize", str(secure_build.folder)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr

    def decoded(objects: list[dict]) -> list[dict]:  # kustomize wraps base64 lines at 76 characters
        out = [o | {"data": _generated([o])[o["metadata"]["name"]]} if o["kind"] == "Secret" else o for o in objects]
        return sorted(out, key=_key)

    assert decoded(_documents_of(result.stdout)) == decoded(secure_build.objects)


def test_the_secure_build_gives_each_service_its_secret_tls_and_probes(secure_build: SecureBuild):
    from gradps.auth.tokens import WORKER, Caller, ClusterSecret

    objects, base = secure_build.objects, _render(K8S)
    assert {_key(o) for o in objects} == {_key(o) for o in base} | {
        ("v1", "Secret", "gradps-secret"),
        ("v1", "Secret", "gradps-worker-token"),
    }
    assert [o for o in base if _pod_spec(o) is None] == [o for o in objects if o in base and _pod_spec(o) is None]
    generated = _generated(objects)
    assert generated["gradps-secret"] == {"secret": f"{secure_build.secret}\n".encode()}
    worker_token = generated["gradps-worker-token"]["token"].decode().strip()
    assert ClusterSecret(secure_build.secret).check(worker_token) == Caller(WORKER), "the plain worker token"
    tls = _serving_certificate()["spec"]["secretName"]  # the Secret cert-manager writes
    for name, workload in _workloads(objects).items():
        container, image = _container(workload), _image(_container(workload))
        env = {e["name"]: e for e in container["env"]}
        reads = _envvars(name)
        assert len(env) == len(container["env"]), f"{name}: a variable set twice"
        assert {"GRADPS_SECRET", "GRADPS_TOKEN"}.isdisjoint(env), f"{name}: a secret in the pod spec itself"
        for i, entry in enumerate(container["env"]):  # as test_every_variable_is_one_the_service_reads
            if entry["name"].startswith("GRADPS_"):
                assert entry["name"] in reads, f"{name} does not read {entry['name']}"
            else:
                assert entry["valueFrom"]["fieldRef"]["fieldPath"] in _DOWNWARD_API, (name, entry)
                later = " ".join(e.get("value", "") for e in container["env"][i + 1 :])
                assert f"$({entry['name']})" in later, f"{name}: {entry['name']} is not used after it is set"
        files = {var: _mounted(workload, env[var]["value"]) for var in _FILE_VARS if var in env}
        secrets_seen = {v["secret"]["secretName"] for v in _pod_spec(workload)["volumes"] if "secret" in v}
        probes = _probes(container)
        assert probes.keys() == {"startupProbe", "readinessProbe", "livenessProbe"}, name
        if name == "gradps-worker":  # the token that joins, and the CA: never the secret or a key
            assert files == {"GRADPS_TOKEN_FILE": ("gradps-worker-token", "token"), "GRADPS_TLS_CA": (tls, "ca.crt")}
            assert secrets_seen == {"gradps-worker-token", tls}
            (tls_volume,) = [v for v in _pod_spec(workload)["volumes"] if v.get("secret", {}).get("secretName") == tls]
            assert [item["key"] for item in tls_volume["secret"]["items"]] == ["ca.crt"], "a worker holds no key"
            for kind, probe in probes.items():  # the coordinator's health, as the worker reaches it: no token
                assert "httpGet" not in probe, kind
                assert probe["exec"]["command"] == [*image.healthcheck, "--without-token"], kind
                assert probe["exec"]["command"][0] in image.copied_executables
                assert probe["timeoutSeconds"] >= 3, f"{name}'s {kind}: a Python process to start"
        else:
            assert files == {
                "GRADPS_SECRET_FILE": ("gradps-secret", "secret"),
                "GRADPS_TLS_CERT": (tls, "tls.crt"),
                "GRADPS_TLS_KEY": (tls, "tls.key"),
                "GRADPS_TLS_CA": (tls, "ca.crt"),
            }, name
            assert secrets_seen == {"gradps-secret", tls}, name
            for kind, probe in probes.items():  # the image's HEALTHCHECK, which speaks TLS
                assert "grpc" not in probe and probe["exec"]["command"] == image.healthcheck, (name, kind)
                assert probe["exec"]["command"][0] in image.copied_executables
                assert probe["timeoutSeconds"] >= 3, f"{name}'s {kind}: a Python process to start"
        for secret, key in files.values():
            assert secret in generated or secret == tls, f"{name}: {secret} is neither generated nor cert-manager's"
            assert secret == tls or key in generated[secret], f"{name}: {secret} has no key {key}"


def _dialed_hosts(objects: list[dict]) -> set[str]:
    """Every host name a service or worker dials: the addresses in the pods' env (the coordinator's
    Service) and each shard's advertised name (placement hands it to the workers)."""
    network = Network(objects, _pods(objects))
    hosts = set()
    for pod in network.pods:
        for value in pod.env.values():
            if re.fullmatch(r"[\w.-]+:\d+", value):
                hosts.add(value.rsplit(":", 1)[0])
        if "GRADPS_ADVERTISE_HOST" in pod.env:
            hosts.add(pod.env["GRADPS_ADVERTISE_HOST"])
    assert all(network.resolve(h) for h in hosts), hosts
    return hosts


def test_the_certificate_names_every_address_the_services_dial(secure_build: SecureBuild):
    objects = _cert_manager()
    assert {o["apiVersion"] for o in objects} == {"cert-manager.io/v1"}
    assert {o["kind"] for o in objects} == {"Issuer", "Certificate"}
    assert all("namespace" not in o["metadata"] for o in objects), "kubectl -n chooses the namespace"
    for build in (K8S, GPU, K8S / "monitoring"):  # no build applies CRDs the strict validation lacks
        assert all(not o["apiVersion"].startswith("cert-manager.io") for o in _render(build)), build
    issuers = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Issuer"}
    certificates = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Certificate"}
    serving = _serving_certificate()

    # The chain: the serving certificate <- a CA issuer <- the CA certificate <- a self-signed issuer.
    assert serving["spec"]["issuerRef"]["kind"] == "Issuer"
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    (ca,) = [c for c in certificates.values() if c["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"]]
    assert ca["spec"]["isCA"] is True
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    assert {"server auth", "client auth"} <= set(serving["spec"]["usages"]), "serving, and calling the others"

    # The Secret it writes is the one the services mount.
    mounted = {
        _mounted(w, e["value"])[0]
        for w in _workloads(secure_build.objects).values()
        for e in _container(w)["env"]
        if e["name"].startswith("GRADPS_TLS_")
    }
    assert mounted == {serving["spec"]["secretName"]}

    # Valid for each name the services dial, with no namespace in them (one Certificate for any),
    # and for loopback, where the health probes connect (127.0.0.1:$GRADPS_PORT).
    dialed = _dialed_hosts(secure_build.objects)
    shards = _workloads(secure_build.objects)["gradps-shard"]["spec"]["replicas"]
    assert len(dialed) == 1 + shards, dialed
    assert all(NAMESPACE not in host for host in dialed), f"a dialed name names the namespace: {dialed}"
    assert dialed <= set(serving["spec"]["dnsNames"]), (
        f"the Certificate misses {dialed - set(serving['spec']['dnsNames'])}"
    )
    assert "127.0.0.1" in serving["spec"]["ipAddresses"]
    # And `gradps certs`, the way without cert-manager, is told the same names where it is documented.
    for doc in (SECURE / "kustomization.yaml", ROOT / "README.md"):
        commands = [h for h in re.findall(r"gradps certs --out \S+ --hosts (\S+)", doc.read_text()) if "gradps-" in h]
        assert commands, f"{doc.name} no longer shows the `gradps certs` of k8s/secure/"
        for hosts in commands:
            assert dialed <= set(hosts.split(",")), (
                f"{doc.name}: `gradps certs --hosts {hosts}` misses some of {dialed}"
            )


@dataclass
class MountedNetwork(Network):
    """Network, with each pod's Secret volumes as folders of this test's: an env value under a mount
    path names the file in that folder."""

    secrets: dict[str, dict[str, bytes]] = field(default_factory=dict)  # Secret name -> key -> content
    root: Path = field(default_factory=Path)

    def local_env(self, pod: Pod) -> dict[str, str]:
        env = super().local_env(pod)
        for mount_path, folder in self._mount(pod).items():
            for key, value in env.items():
                if value.startswith(mount_path + "/"):
                    env[key] = str(folder / value.removeprefix(mount_path + "/"))
        return env

    def _mount(self, pod: Pod) -> dict[str, Path]:
        """The pod's Secret volumes, written as the kubelet projects them (their items, else every key)."""
        volumes = {v["name"]: v for v in _pod_spec(pod.workload).get("volumes", [])}
        mounts = {}
        for mount in pod.container.get("volumeMounts", []):
            # A state volume (the coordinator's claim, a shard's claim template): LocalPods gives
            # the pod a folder of its own.
            secret = volumes.get(mount["name"], {}).get("secret")
            if secret is None:
                continue
            data = self.secrets[secret["secretName"]]
            folder = self.root / pod.name / mount["mountPath"].strip("/")
            folder.mkdir(parents=True, exist_ok=True)
            for item in secret.get("items") or [{"key": k, "path": k} for k in data]:
                (folder / item["path"]).write_bytes(data[item["key"]])
            mounts[mount["mountPath"].rstrip("/")] = folder
        return mounts


@pytest.mark.slow  # the plain pods' test stays in the everyday suite
@pytest.mark.timeout(180)
def test_the_secure_pods_form_a_cluster_as_local_processes(secure_build: SecureBuild, tmp_path: Path):
    from gradps.auth.tokens import ADMIN, ClusterSecret
    from gradps.v1 import coordinator_pb2, coordinator_pb2_grpc

    # gradps-tls as kustomization.yaml makes it without cert-manager, for the Certificate's names.
    serving = _serving_certificate()["spec"]
    certs = tmp_path / "certs"
    _gradps("certs", "--out", str(certs), "--hosts", ",".join([*serving["dnsNames"], *serving["ipAddresses"]]))
    tls = {"tls.crt": "service.pem", "tls.key": "service-key.pem", "ca.crt": "ca.pem"}
    volumes = _generated(secure_build.objects) | {
        serving["secretName"]: {key: (certs / name).read_bytes() for key, name in tls.items()}
    }
    objects = secure_build.objects
    network = MountedNetwork(objects, _pods(objects), secrets=volumes, root=tmp_path / "volumes")
    pods = LocalPods(network, tmp_path)
    shards = [p for p in network.pods if _role(p) == "shard"]
    workers = [p for p in network.pods if _role(p) == "worker"]
    coordinator = network.dial("gradps-coordinator", 50051)
    credentials = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    admin = [("authorization", f"Bearer {ClusterSecret(secure_build.secret).token(ADMIN)}")]
    request = coordinator_pb2.GetClusterRequest()
    try:
        pods.start()
        expected_shards = sorted(f"{_LOCALHOST}:{network.local[p.name, p.ports[0]]}" for p in shards)
        expected_workers = sorted(p.name for p in workers)
        with grpc.secure_channel(coordinator, credentials) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            while True:
                pods.check_alive()
                try:
                    reply = stub.GetCluster(request, timeout=5, metadata=admin)
                    found, live = sorted(reply.shards), sorted(w.name for w in reply.workers if w.alive)
                except grpc.RpcError as e:  # the coordinator is still importing torch
                    found, live = [], [e.code().name]
                if found == expected_shards and live == expected_workers:
                    break
                pods.remaining(f"2 shards and 2 workers; the coordinator has {found}, {live}")
                time.sleep(0.25)
            with pytest.raises(grpc.RpcError) as refused:  # a token is needed
                stub.GetCluster(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(coordinator) as plaintext, pytest.raises(grpc.RpcError) as refused:
            coordinator_pb2_grpc.CoordinatorServiceStub(plaintext).GetCluster(request, timeout=5, metadata=admin)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, "TLS only"
        for pod in network.pods:  # every probe passes on the running cluster
            for kind, probe in _probes(pod.container).items():
                problem = pods.probe(pod, probe)
                assert problem is None, f"{pod.name}'s {kind} fails: {problem}\n{pods.logs_tail()}"
    finally:
        codes = pods.stop()
    assert all(code is not None for code in codes.values()), f"killed after the grace period: {codes}"
    assert codes == dict.fromkeys(codes, 0), f"exit codes after SIGTERM: {codes}\n{pods.logs_tail()}"
