"""deploy/kubernetes/: every overlay renders, every object is valid, and they fit together.

No cluster and no kubectl: the test renders each overlay with the small subset of
kustomize the manifests use (resources, secretGenerator from files with fixed names,
JSON 6902 patches by kind and name), loads every object through the official `kubernetes`
client's typed models, and strictly (the client's own deserialiser ignores unknown keys,
so a walk over its `openapi_types` rejects a misspelt field or a wrong type), and checks
the references between objects. Each check is also run on a deliberately broken copy, so
none of them can pass vacuously. Where kubectl is installed, the renderer is compared
with `kubectl kustomize`.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.k8s_manifests import OVERLAYS, ROOT, Obj, build, check, named


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes with the secret files a user writes before building."""
    root = tmp_path_factory.mktemp("kubernetes") / "kubernetes"
    shutil.copytree(ROOT, root)
    (root / "base" / "secrets" / "internal-token").write_text("x" * 32)
    (root / "base" / "secrets" / "api-key").write_text("sk-test")
    return root


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_valid_consistent_objects(tree: Path, overlay: str) -> None:
    objects = build(tree / "overlays" / overlay)
    kinds = sorted({obj["kind"] for obj in objects})
    assert kinds == sorted({"ServiceAccount", "Deployment", "StatefulSet", "Service",
                            "HorizontalPodAutoscaler", "NetworkPolicy", "PodDisruptionBudget",
                            "ServiceMonitor", "Secret"})
    check(objects)


def _verifier(objects: list[Obj]) -> Obj:
    return named(objects, "StatefulSet")["specdec-verifier"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay, resource, device", [
    ("cpu", None, "cpu"), ("cuda", "nvidia.com/gpu", "cuda"),
    ("ascend", "huawei.com/Ascend910", "npu")])
def test_overlay_sets_the_device(tree: Path, overlay: str, resource: str | None,
                                 device: str) -> None:
    spec = _verifier(build(tree / "overlays" / overlay))
    container = spec["containers"][0]
    assert f"--device={device}" in container["args"]
    extended = {k for k in container["resources"]["limits"] if "/" in k}
    assert extended == ({resource} if resource else set())
    if overlay == "ascend":
        mounted = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
                "/etc/ascend_install.info"} <= mounted


def test_verifier_has_native_grpc_probes_and_one_pod_per_node(tree: Path) -> None:
    spec = _verifier(build(tree / "overlays" / "cpu"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec["containers"][0][probe]["grpc"] == {"port": 50051}
    term = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term[0]["topologyKey"] == "kubernetes.io/hostname"


def _mutations() -> dict[str, Any]:
    """Small breakages, each of which one check must catch."""
    def container(objects: list[Obj], kind: str, name: str) -> Obj:
        return named(objects, kind)[name]["spec"]["template"]["spec"]["containers"][0]

    def svc(objects: list[Obj], name: str) -> Obj:
        return named(objects, "Service")[name]["spec"]

    return {
        "misspelt field": lambda o: container(o, "Deployment", "specdec-gateway").update(
            {"imagePullPolcy": "Always"}),
        "wrong type": lambda o: container(o, "StatefulSet", "specdec-verifier")["ports"][0]
        .update(containerPort="50051"),
        "unknown kind": lambda o: o.append({"apiVersion": "apps/v1", "kind": "Deploymnt",
                                            "metadata": {"name": "x"}}),
        "wrong target port": lambda o: svc(o, "specdec-drafter")["ports"][0].update(
            targetPort=50053),
        "wrong probe port": lambda o: container(o, "StatefulSet", "specdec-verifier")[
            "readinessProbe"]["grpc"].update(port=50052),
        "selector misses pods": lambda o: svc(o, "specdec-gateway")["selector"].update(
            {"app.kubernetes.io/name": "gateway"}),
        "missing secret": lambda o: o.remove(named(o, "Secret")["specdec-api-key"]),
        "missing secret key": lambda o: container(o, "Deployment", "specdec-gateway")["env"][1][
            "valueFrom"]["secretKeyRef"].update(key="key"),
        "hpa target": lambda o: named(o, "HorizontalPodAutoscaler")["specdec-drafter"]["spec"][
            "scaleTargetRef"].update(name="drafter"),
        "pdb selector": lambda o: named(o, "PodDisruptionBudget")["specdec-verifier"]["spec"][
            "selector"]["matchLabels"].update({"app.kubernetes.io/name": "verifier"}),
        "policy port": lambda o: named(o, "NetworkPolicy")["specdec-drafter"]["spec"][
            "ingress"][0]["ports"][0].update(port=50051),
        "monitor port": lambda o: named(o, "ServiceMonitor")["specdec"]["spec"]["endpoints"][
            1].update(port="prometheus"),
        "monitor field": lambda o: named(o, "ServiceMonitor")["specdec"]["spec"]["endpoints"][
            1].update(intervall="5s"),
        "service account": lambda o: o.remove(named(o, "ServiceAccount")["specdec"]),
        "gateway misses a verifier": lambda o: named(o, "StatefulSet")["specdec-verifier"][
            "spec"].update(replicas=3),
        "flag and port disagree": lambda o: container(o, "Deployment", "specdec-drafter")[
            "args"].__setitem__(1, "--port=50053"),
        "missing required field": lambda o: container(o, "Deployment", "specdec-gateway").pop(
            "name"),
        "mount without volume": lambda o: container(o, "Deployment", "specdec-drafter")[
            "volumeMounts"][1].update(name="cache"),
    }


EXPECTED = {
    "misspelt field": "V1Container has no field 'imagePullPolcy'",
    "wrong type": r"containerPort: expected an int",
    "unknown kind": "unknown apiVersion/kind",
    "wrong target port": "Service/specdec-drafter: targetPort 50053",
    "wrong probe port": "specdec-verifier: readinessProbe port",
    "selector misses pods": "Service/specdec-gateway selects no pods",
    "missing secret": "specdec-api-key",
    "missing secret key": r"'key': 'key'",
    "hpa target": "'drafter'",
    "pdb selector": "PodDisruptionBudget/specdec-verifier selects no pods",
    "policy port": "NetworkPolicy/specdec-drafter: port 50051",
    "monitor port": "no Service port",
    "monitor field": "intervall",
    "service account": "no ServiceAccount specdec",
    "gateway misses a verifier": "is not the 3 verifier pods",
    "flag and port disagree": "specdec-drafter: --port",
    "mount without volume": "mount cache has no volume",
    # The client's own models (pydantic in kubernetes>=35) enforce required fields.
    "missing required field": "V1Container",
}


@pytest.mark.parametrize("mutation", sorted(_mutations()))
def test_a_broken_copy_fails(tree: Path, mutation: str) -> None:
    objects = build(tree / "overlays" / "cuda")
    check(copy.deepcopy(objects))  # the intact copy passes ...
    _mutations()[mutation](objects)
    # ... the broken one does not, and for the reason the mutation is about.
    with pytest.raises((AssertionError, KeyError, ValueError), match=EXPECTED[mutation]):
        check(objects)


def test_a_patch_of_a_missing_object_or_path_fails(tree: Path, tmp_path: Path) -> None:
    shutil.copytree(tree, tmp_path / "k")
    overlay = tmp_path / "k" / "overlays" / "cpu"
    spec = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    spec["patches"][0]["target"]["name"] = "verifier"
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(LookupError):
        build(overlay)
    overlay = tmp_path / "k" / "overlays" / "cuda"
    ops = yaml.safe_load((overlay / "verifier.yaml").read_text())
    ops[0]["path"] = "/spec/template/spec/containers/0/imag"
    (overlay / "verifier.yaml").write_text(yaml.safe_dump(ops))
    with pytest.raises(KeyError):
        build(overlay)


def test_every_overlay_patch_targets_the_base(tree: Path) -> None:
    base = {(o["kind"], o["metadata"]["name"]) for o in build(tree / "base")}
    for overlay in OVERLAYS:
        spec = yaml.safe_load((tree / "overlays" / overlay / "kustomization.yaml").read_text())
        assert spec["resources"] == ["../../base"]
        for patch in spec["patches"]:
            assert (patch["target"]["kind"], patch["target"]["name"]) in base


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_agrees_with_kubectl_kustomize(tree: Path, overlay: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(tree / "overlays" / overlay)],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    theirs = [doc for doc in yaml.safe_load_all(out) if doc]
    for obj in theirs:  # kustomize writes generated Secrets as base64 `data`
        if obj["kind"] == "Secret":
            obj["stringData"] = {k: base64.b64decode(v).decode() for k, v in obj.pop("data").items()}
    ours = build(tree / "overlays" / overlay)

    def key(obj: Obj) -> str:
        return json.dumps(obj, sort_keys=True)
    assert sorted(map(key, ours)) == sorted(map(key, theirs))
