"""The Kubernetes manifests (mount/kubernetes): valid against the Kubernetes schemas, and
consistent where a slip would only show on a cluster, which cannot run here.

kubernetes-validate ships the schemas of each release in the package and resolves their
references among those files: validation needs no network (checked with ``unshare -n``)."""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from coordlfs.cli import build_parser
from coordlfs.daemon.options import given, parse
from coordlfs.errors import UserError
from coordlfs.peers.placement import read_secret

KUBE = Path(__file__).resolve().parents[2] / "mount" / "kubernetes"
#: the oldest and the newest release of those kubernetes-validate ships that are maintained
VERSIONS = ("1.35", "1.37")
#: the daemon's own memory beside its cache (configmap.yaml says so): the memory limit holds both
DAEMON_ROOM = 2 << 30
_QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi|Ti)?")


def _load(path: Path) -> dict[str, Any]:
    """The one resource in ``path`` (one per file, so that kustomize lists each)."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(documents) == 1, f"{path.name}: one resource per file"
    return documents[0]


MANIFESTS = sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml")
BASE = {p.name: _load(p) for p in MANIFESTS if p.parent == KUBE}
EXAMPLE = _load(KUBE / "example" / "training-job.yaml")


def _one(kind: str) -> dict[str, Any]:
    (resource,) = [r for r in BASE.values() if r["kind"] == kind]
    return resource


DAEMONSET, SERVICE, CONFIG, SECRET = (_one(k) for k in ("DaemonSet", "Service", "ConfigMap",
                                                        "Secret"))
POD = DAEMONSET["spec"]["template"]["spec"]
(CONTAINER,) = POD["containers"]


#: the downward API's fields the container takes, as the kubelet would give them
DOWNWARD = {"status.podIP": "192.0.2.10"}


def _expanded_args() -> list[str]:
    """The container's args with ``$(VAR)`` replaced as the kubelet does, from the ConfigMap
    or the downward API."""
    env = {}
    for variable in CONTAINER["env"]:
        source = variable["valueFrom"]
        if "fieldRef" in source:
            env[variable["name"]] = DOWNWARD[source["fieldRef"]["fieldPath"]]
            continue
        ref = source["configMapKeyRef"]
        assert ref["name"] == CONFIG["metadata"]["name"]
        env[variable["name"]] = CONFIG["data"][ref["key"]]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in CONTAINER["args"]]


ARGS = build_parser().parse_args(_expanded_args())
#: what `coordlfs mount` makes of the DaemonSet's args: its own parser, its own checks
OPTIONS = parse(given(ARGS, ARGS.sloppy))


def _mounted_at(path: str, container: dict[str, Any], pod: dict[str, Any]) -> tuple[dict, dict]:
    """The volumeMount holding ``path`` in ``container`` (the deepest) and its volume."""
    mounts = [m for m in container["volumeMounts"]
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"nothing mounted at {path}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def _bytes(quantity: str) -> int:
    number, suffix = _QUANTITY.fullmatch(quantity).groups()
    return int(number) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[suffix]


def test_kustomization_lists_exactly_the_base_files() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(BASE)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(KUBE)))
def test_manifest_is_valid(path: Path, version: str) -> None:
    """Strict: a field the schema does not know (a typo) is an error, as kubectl's
    server-side field validation makes it."""
    kubernetes_validate.validate(_load(path), version, strict=True)


def test_validation_catches_a_misspelt_field() -> None:
    """The validation above means something: the same DaemonSet with one field misspelt
    fails."""
    wrong = copy.deepcopy(DAEMONSET)
    wrong["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(wrong, VERSIONS[-1], strict=True)


def test_mount_is_privileged_with_fuse_and_shows_on_the_node() -> None:
    assert CONTAINER["securityContext"]["privileged"] is True
    # readers' pids as the host knows them: aligned groups and per-job statistics go by pid
    assert POD["hostPID"] is True
    fuse_mount, fuse = _mounted_at("/dev/fuse", CONTAINER, POD)
    assert fuse_mount["mountPath"] == "/dev/fuse"
    assert fuse["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    mount, volume = _mounted_at(ARGS.mountpoint, CONTAINER, POD)
    assert mount["mountPropagation"] == "Bidirectional"
    assert "hostPath" in volume
    # the mountpoint's parent is the volume: a dead mount left by a killed daemon cannot
    # break the volume, and the next container can unmount it
    assert ARGS.mountpoint != mount["mountPath"]
    source_mount, source = _mounted_at(ARGS.source, CONTAINER, POD)
    assert source_mount["readOnly"] is True and source["hostPath"]["type"] == "Directory"


def test_mount_runs_in_the_foreground_with_the_cache_in_pod_memory() -> None:
    assert CONTAINER["args"][0] == "mount" and OPTIONS["foreground"] is True
    assert "log" not in OPTIONS  # stderr, the container's log
    _, cache = _mounted_at(OPTIONS["cache_dir"], CONTAINER, POD)
    assert cache["emptyDir"]["medium"] == "Memory"
    limit = _bytes(CONTAINER["resources"]["limits"]["memory"])
    assert OPTIONS["cache_size"] + DAEMON_ROOM <= limit, "the cache must fit the memory limit"


def test_probes_and_prestop_name_the_mountpoint() -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert CONTAINER[probe]["exec"]["command"] == ["coordlfs", "stats", ARGS.mountpoint]
    pre_stop = CONTAINER["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["coordlfs", "umount", ARGS.mountpoint]


def test_entrypoint_runs_coordlfs_with_the_args() -> None:
    """The shell in front creates the mountpoint (``$3``: the script's args are ``mount
    SOURCE MOUNTPOINT ...``) and execs ``coordlfs`` with every arg."""
    shell, flag, script, _ = CONTAINER["command"]
    assert (shell, flag) == ("/bin/sh", "-c")
    assert 'mkdir -p "$3"' in script and 'exec coordlfs "$@"' in script
    assert CONTAINER["args"][1:3] == [ARGS.source, ARGS.mountpoint]


def test_peers_are_the_headless_services_pods() -> None:
    namespace = DAEMONSET["metadata"]["namespace"]
    assert SERVICE["metadata"]["namespace"] == namespace
    assert _one("Namespace")["metadata"]["name"] == namespace
    name, port = OPTIONS["peers_from"].removeprefix("dns:").rsplit(":", 1)
    assert name == f"{SERVICE['metadata']['name']}.{namespace}.svc.cluster.local"
    spec = SERVICE["spec"]
    assert spec["clusterIP"] == "None"
    # a peer is every pod with an IP, not only those whose readiness probe passes just now
    assert spec["publishNotReadyAddresses"] is True
    labels = DAEMONSET["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"].items() <= labels.items()
    assert DAEMONSET["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (service_port,) = spec["ports"]
    ports = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
    listen_port = int(OPTIONS["listen"].rsplit(":", 1)[1])
    assert int(port) == service_port["port"] == ports[service_port["targetPort"]] == listen_port
    assert POD.get("hostNetwork", False) is False  # pod IPs, which the Service publishes


def test_metrics_port_is_declared_and_scraped() -> None:
    host, _, number = OPTIONS["metrics"].rpartition(":")
    assert host == DOWNWARD["status.podIP"]  # the pod's own address, not every address
    port = int(number)
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in CONTAINER["ports"]
    annotations = DAEMONSET["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                           "prometheus.io/path": "/metrics"}


def test_secret_is_a_file_only_root_reads(tmp_path: Path) -> None:
    mount, volume = _mounted_at(OPTIONS["secret_file"], CONTAINER, POD)
    assert mount["readOnly"] is True
    assert volume["secret"]["secretName"] == SECRET["metadata"]["name"]
    assert volume["secret"]["defaultMode"] in (0o400, 0o600)
    key = os.path.relpath(OPTIONS["secret_file"], mount["mountPath"])
    placeholder = tmp_path / "placeholder"
    placeholder.write_text(SECRET["stringData"][key])
    placeholder.chmod(volume["secret"]["defaultMode"])
    with pytest.raises(UserError, match="bytes"):  # forgotten, it stops the mount
        read_secret(str(placeholder))
    generated = tmp_path / "generated"  # as documented: head -c 32 /dev/urandom | base64
    generated.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    generated.chmod(volume["secret"]["defaultMode"])
    assert len(read_secret(str(generated))) == 44


def test_root_filesystems_are_read_only() -> None:
    for container in (CONTAINER, *EXAMPLE["spec"]["template"]["spec"]["containers"]):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_example_job_reads_the_mount_from_the_node() -> None:
    pod = EXAMPLE["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mount, volume = _mounted_at(ARGS.mountpoint, container, pod)
    _, daemon_volume = _mounted_at(ARGS.mountpoint, CONTAINER, POD)
    assert volume["hostPath"]["path"] == daemon_volume["hostPath"]["path"]
    assert mount["mountPropagation"] == "HostToContainer" and mount["readOnly"] is True
    assert f'root = "{ARGS.mountpoint}"' in container["command"][-1]
    assert pod["nodeSelector"].items() <= POD["nodeSelector"].items()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_base() -> None:
    """kubectl's own kustomize (offline) builds the base into exactly its resources."""
    built = subprocess.run(["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    names = sorted((r["kind"], r["metadata"]["name"]) for r in yaml.safe_load_all(built))
    assert names == sorted((r["kind"], r["metadata"]["name"]) for r in BASE.values())
