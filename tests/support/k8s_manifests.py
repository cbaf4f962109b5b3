"""A renderer for the kustomize subset deploy/kubernetes/ uses, and the checks on what it
renders (tests/service/test_kubernetes_manifests.py).

`build` renders a kustomization: resources, secretGenerator from files with fixed names
(`disableNameSuffixHash`), JSON 6902 patches targeted by kind and name; any other field
fails. `load` reads an object through the official `kubernetes` client's typed models,
and strictly: the client's own deserialiser drops unknown keys and coerces types, so a
walk over its `openapi_types` rejects a misspelt field or a wrong type first.
`check_references` checks what ties the objects together.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes.client.models as k8s_models
import yaml
from kubernetes.client import ApiClient

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "cuda", "ascend")
# apiVersion, kind -> the client's model. A kind the cluster would not know fails here.
MODELS = {
    ("v1", "Service"): "V1Service", ("v1", "Secret"): "V1Secret",
    ("v1", "ConfigMap"): "V1ConfigMap", ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("apps/v1", "Deployment"): "V1Deployment", ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
}
WORKLOADS = ("Deployment", "StatefulSet")
Obj = dict[str, Any]


# --- the kustomize subset -------------------------------------------------------------

def _pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.split("/")[1:]]


def apply_json6902(doc: Obj, ops: list[Obj]) -> None:
    """RFC 6902 add / replace / remove, strict as kustomize: a missing parent fails."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), op["value"])
            else:
                node[last] = op["value"]
        elif op["op"] == "replace":
            if isinstance(node, list):
                node[int(last)] = op["value"]
            elif last not in node:
                raise KeyError(f"replace: {op['path']} does not exist")
            else:
                node[last] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise ValueError(f"unsupported JSON patch op {op['op']!r}")


def build(directory: Path) -> list[Obj]:
    """`kustomize build` for the fields the manifests use; any other field fails."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "secretGenerator", "generatorOptions", "patches"}
    assert set(spec) <= known, f"{directory}: renderer does not support {set(spec) - known}"
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += build(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    if spec.get("secretGenerator"):
        assert spec["generatorOptions"] == {"disableNameSuffixHash": True}
    for generator in spec.get("secretGenerator", []):
        assert set(generator) == {"name", "files"}
        data = {}
        for item in generator["files"]:
            key, _, source = item.partition("=")
            data[key] = (directory / source).read_text()
        objects.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": generator["name"]}, "stringData": data})
    for patch in spec.get("patches", []):
        target = patch["target"]
        assert set(target) == {"kind", "name"}, "patch targets name a kind and a name"
        matches = [obj for obj in objects if obj["kind"] == target["kind"]
                   and obj["metadata"]["name"] == target["name"]]
        if len(matches) != 1:
            raise LookupError(f"{directory}: patch target {target} matches {len(matches)} objects")
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        apply_json6902(matches[0], ops)
    return objects


# --- typed loading --------------------------------------------------------------------

def _model(name: str) -> Any:
    return getattr(k8s_models, name)


def strict(data: Any, type_name: str, where: str) -> None:
    """Every key known to the model, every value of its declared type."""
    if type_name.startswith("Optional["):
        strict(data, type_name[9:-1], where)
    elif type_name.startswith(("List[", "list[")):
        assert isinstance(data, list), f"{where}: expected a list"
        for index, item in enumerate(data):
            strict(item, type_name[5:-1], f"{where}[{index}]")
    elif type_name.startswith(("Dict[", "dict(")):
        assert isinstance(data, dict), f"{where}: expected a mapping"
        value_type = type_name[5:-1].split(", ", 1)[1]
        for key, value in data.items():
            strict(value, value_type, f"{where}.{key}")
    elif type_name == "object":  # IntOrString and free-form fields
        assert data is not None, f"{where}: empty"
    elif type_name in ("str", "datetime", "date", "bytes"):
        assert isinstance(data, str), f"{where}: expected a string, got {data!r}"
    elif type_name == "int":
        assert isinstance(data, int) and not isinstance(data, bool), f"{where}: expected an int"
    elif type_name == "bool":
        assert isinstance(data, bool), f"{where}: expected a bool, got {data!r}"
    elif type_name == "float":
        assert isinstance(data, (int, float)), f"{where}: expected a number"
    else:
        model = _model(type_name)
        assert isinstance(data, dict), f"{where}: expected a {type_name} mapping"
        by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
        for key, value in data.items():
            assert key in by_json, f"{where}: {type_name} has no field {key!r}"
            strict(value, model.openapi_types[by_json[key]], f"{where}.{key}")


SERVICE_MONITOR_FIELDS = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "spec": {"selector", "endpoints", "namespaceSelector", "jobLabel"},
    "endpoint": {"port", "path", "interval", "scheme", "scrapeTimeout"},
}


def load(obj: Obj) -> Any:
    """The typed model of `obj` (the ServiceMonitor CRD: a small schema of our own)."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("kind") == "ServiceMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(obj) <= SERVICE_MONITOR_FIELDS[""], name
        strict(obj["metadata"], "V1ObjectMeta", name)
        assert set(obj["spec"]) <= SERVICE_MONITOR_FIELDS["spec"], name
        strict(obj["spec"]["selector"], "V1LabelSelector", name)
        assert obj["spec"]["endpoints"], f"{name}: no endpoints"
        for endpoint in obj["spec"]["endpoints"]:
            assert set(endpoint) <= SERVICE_MONITOR_FIELDS["endpoint"], f"{name}: {endpoint}"
            assert all(isinstance(value, str) for value in endpoint.values()), name
        return obj
    model = MODELS.get((obj.get("apiVersion"), obj.get("kind")))
    assert model is not None, f"{name}: unknown apiVersion/kind {obj.get('apiVersion')}"
    strict(obj, model, name)
    # The client's own deserialiser on top: required fields and enums of the models.
    return ApiClient()._ApiClient__deserialize(copy.deepcopy(obj), model)


# --- cross-references -----------------------------------------------------------------

def named(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _pods(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    return [(obj, obj["spec"]["template"]) for obj in objects if obj["kind"] in WORKLOADS]


def _port_names_and_numbers(template: Obj) -> set[Any]:
    ports: set[Any] = set()
    for container in template["spec"]["containers"]:
        for port in container.get("ports", []):
            ports |= {port["containerPort"], port.get("name")}
    return ports - {None}


def check_references(objects: list[Obj]) -> None:
    secrets, services = named(objects, "Secret"), named(objects, "Service")
    accounts, config_maps = named(objects, "ServiceAccount"), named(objects, "ConfigMap")
    names = [(obj["kind"], obj["metadata"]["name"]) for obj in objects]
    assert len(names) == len(set(names)), "duplicate objects"
    pods = _pods(objects)
    for workload, template in pods:
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        assert _matches(workload["spec"]["selector"]["matchLabels"],
                        template["metadata"]["labels"]), f"{where}: selector misses its pods"
        spec = template["spec"]
        assert spec.get("serviceAccountName", "default") in accounts, \
            f"{where}: no ServiceAccount {spec.get('serviceAccountName')}"
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        ports = _port_names_and_numbers(template)
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims, \
                    f"{where}: mount {mount['name']} has no volume"
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(probe_name) or {}
                for action in ("grpc", "httpGet", "tcpSocket"):
                    if action in probe:
                        assert probe[action]["port"] in ports, f"{where}: {probe_name} port"
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], f"{where}: {ref}"
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["name"] in config_maps, f"{where}: {ref}"
        for volume in volumes.values():
            sources = volume.get("projected", {}).get("sources", []) + [volume]
            for source in sources:
                ref = source.get("secret")
                if ref and not ref.get("optional"):
                    name = ref.get("name") or ref.get("secretName")
                    keys = secrets[name]["stringData"]
                    assert all(item["key"] in keys for item in ref.get("items", [])), where
                if "configMap" in source and not source["configMap"].get("optional"):
                    assert source["configMap"]["name"] in config_maps, where
                claim = source.get("persistentVolumeClaim")
                assert claim is None, f"{where}: shared PVCs are not part of these manifests"
        if workload["kind"] == "StatefulSet":
            governing = services[workload["spec"]["serviceName"]]
            assert governing["spec"].get("clusterIP") == "None", f"{where}: needs a headless Service"
    for service in services.values():
        backing = [t for _, t in pods if _matches(service["spec"]["selector"],
                                                  t["metadata"]["labels"])]
        assert backing, f"Service/{service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            for template in backing:
                assert port.get("targetPort", port["port"]) in _port_names_and_numbers(template), \
                    f"Service/{service['metadata']['name']}: targetPort {port.get('targetPort')}"
    workloads = {(obj["kind"], obj["metadata"]["name"]): obj for obj, _ in pods}
    for hpa in named(objects, "HorizontalPodAutoscaler").values():
        ref = hpa["spec"]["scaleTargetRef"]
        target = workloads[(ref["kind"], ref["name"])]
        for container in target["spec"]["template"]["spec"]["containers"]:
            # A CPU-utilisation target needs a CPU request on every container.
            assert "cpu" in container["resources"]["requests"], f"HPA {ref['name']}: no cpu request"
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for obj in named(objects, kind).values():
            selector = (obj["spec"].get("selector") or obj["spec"]["podSelector"])["matchLabels"]
            assert any(_matches(selector, t["metadata"]["labels"]) for _, t in pods), \
                f"{kind}/{obj['metadata']['name']} selects no pods"
            for rule in obj["spec"].get("ingress", []):
                for peer in rule.get("from", []):
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        assert any(_matches(peer["podSelector"]["matchLabels"],
                                            t["metadata"]["labels"]) for _, t in pods), kind
                for port in rule.get("ports", []):
                    assert any(port["port"] in _port_names_and_numbers(t) for _, t in pods
                               if _matches(selector, t["metadata"]["labels"])), \
                        f"{kind}/{obj['metadata']['name']}: port {port['port']}"
    for monitor in named(objects, "ServiceMonitor").values():
        selected = [s for s in services.values()
                    if _matches(monitor["spec"]["selector"]["matchLabels"],
                                s["metadata"].get("labels", {}))]
        port_names = {p.get("name") for s in selected for p in s["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names, f"ServiceMonitor: no Service port {endpoint}"
    check_service_addresses(objects)


def _args(objects: list[Obj], kind: str, name: str) -> list[str]:
    return named(objects, kind)[name]["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args: list[str], flag: str) -> str | None:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    return values[0] if values else None


def check_service_addresses(objects: list[Obj]) -> None:
    """What the flags say agrees with the objects: each service binds the ports its
    container declares; the gateway lists every verifier pod; the verifier's --drafter is
    the headless drafter Service, whose DNS gives pod addresses, so its port must be the
    pods' own; every service reads the token from the mounted Secret."""
    for kind, name, flags in (("Deployment", "specdec-gateway", {"--port": "http"}),
                              ("StatefulSet", "specdec-verifier",
                               {"--port": "grpc", "--metrics-port": "metrics"}),
                              ("Deployment", "specdec-drafter",
                               {"--port": "grpc", "--metrics-port": "metrics"})):
        container = named(objects, kind)[name]["spec"]["template"]["spec"]["containers"][0]
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        for flag, port_name in flags.items():
            assert _flag(container["args"], flag) == str(ports[port_name]), f"{name}: {flag}"
        assert _flag(container["args"], "--host") == "0.0.0.0", f"{name}: binds loopback"
        assert _flag(container["args"], "--internal-token-file") == \
            "/run/secrets/specdec_internal_token", name
    verifier = named(objects, "StatefulSet")["specdec-verifier"]
    service, replicas = verifier["spec"]["serviceName"], verifier["spec"]["replicas"]
    grpc_port = named(objects, "Service")[service]["spec"]["ports"][0]["port"]
    listed = [a.split("=", 1)[1] for a in _args(objects, "Deployment", "specdec-gateway")
              if a.startswith("--verifier=")]
    assert listed == [f"specdec-verifier-{i}.{service}:{grpc_port}" for i in range(replicas)], \
        f"the gateway's --verifier list {listed} is not the {replicas} verifier pods"
    drafter_service = named(objects, "Service")["specdec-drafter"]
    assert drafter_service["spec"]["clusterIP"] == "None"
    drafter_container = named(objects, "Deployment")["specdec-drafter"]["spec"]["template"][
        "spec"]["containers"][0]
    pod_port = {p["name"]: p["containerPort"] for p in drafter_container["ports"]}["grpc"]
    assert drafter_service["spec"]["ports"][0]["port"] == pod_port
    assert _flag(verifier["spec"]["template"]["spec"]["containers"][0]["args"], "--drafter") \
        == f"specdec-drafter:{pod_port}"


def check(objects: list[Obj]) -> None:
    for obj in objects:
        load(obj)
    check_references(objects)
