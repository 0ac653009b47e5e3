"""The DaemonSet's container, run as written in mount/kubernetes/daemonset.yaml, on nodes
that are network namespaces of this machine.

No cluster runs here, so what Kubernetes itself does (scheduling, the propagation of the mount
to the node, the probes' timing) is not tested; the commands it would run are, for real: the
container's command and args, the probes, the preStop hook, the example Job's script. Each
volume is a directory of this machine (the emptyDir of medium Memory a tmpfs, the Secret a
file of mode ``defaultMode``), and a container path in a command becomes the path of its
volume's directory. Each pod has a mount namespace of its own, in which /etc/hosts answers the
headless Service's name with the nodes' addresses as the cluster's DNS would (through the same
getaddrinfo), and which takes the pod's mounts with it when the pod's process ends.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import make_dataset

from coordlfs.testbed.mounts import stop_daemon, unmount_if_mounted
from coordlfs.testbed.netns import Node, cluster_network

KUBE = Path(__file__).resolve().parents[2] / "mount" / "kubernetes"
#: where the `coordlfs` command of this checkout is (the image has it on PATH)
BIN = Path(sys.executable).parent
#: seconds for a pod's mount to come up, as its startupProbe allows it
START_WAIT = 60


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((KUBE / name).read_text())


DAEMONSET, CONFIG = _load("daemonset.yaml"), _load("configmap.yaml")
JOB = _load("example/training-job.yaml")
SERVICE = _load("service.yaml")
POD = DAEMONSET["spec"]["template"]["spec"]
(CONTAINER,) = POD["containers"]
VOLUMES = {v["name"]: v for v in POD["volumes"]}
MOUNTPOINT = CONTAINER["args"][2]  # coordlfs mount SOURCE MOUNTPOINT ...


def _peers_name() -> str:
    """The name the mounts resolve, as --peers-from gives it."""
    args = CONTAINER["args"]
    source = args[args.index("--peers-from") + 1]
    return source.removeprefix("dns:").rsplit(":", 1)[0]


@dataclass
class Pod:
    """One node's DaemonSet pod: its process, its volumes' directories, its log."""

    node: Node
    root: Path
    log: Path
    process: subprocess.Popen | None = None

    def path(self, inside: str) -> str | None:
        """The file of this machine behind ``inside``, a path of the container; None if no
        volume holds it (``/bin/sh``, a program's path)."""
        for mount in sorted(CONTAINER["volumeMounts"], key=lambda m: -len(m["mountPath"])):
            where = mount["mountPath"]
            if inside == where or inside.startswith(where + "/"):
                if VOLUMES[mount["name"]].get("hostPath", {}).get("type") == "CharDevice":
                    return inside  # /dev/fuse is this machine's
                return str(self.root / mount["name"]) + inside[len(where):]
        return None

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` with each container path on a volume made the path of this machine."""
        return [self.path(a) or a for a in argv]

    def enter(self) -> list[str]:
        """Prefix: run in this pod's network and mount namespaces (with its PATH)."""
        assert self.process is not None
        return ["nsenter", "-t", str(self.process.pid), "-m", "-n", "env",
                f"PATH={BIN}:{os.environ['PATH']}"]

    def run(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*self.enter(), *self.command(argv)], capture_output=True,
                              text=True, timeout=timeout)


def _volumes(pod: Pod, dataset: Path, secret: bytes) -> None:
    """Each volume's directory, filled as the kubelet would fill it."""
    for name, volume in VOLUMES.items():
        directory = pod.root / name
        if name == "dataset":
            shutil.copytree(dataset, directory, copy_function=shutil.copy2)
        elif "secret" in volume:
            directory.mkdir(parents=True)
            (directory / "secret").write_bytes(secret)
            (directory / "secret").chmod(volume["secret"]["defaultMode"])
        elif volume.get("hostPath", {}).get("type") != "CharDevice":
            directory.mkdir(parents=True)


def _expanded(args: list[str], pod: Pod) -> list[str]:
    """``$(VAR)`` replaced from the ConfigMap or the downward API (the pod's IP is its
    node's address), as the kubelet does."""
    downward = {"status.podIP": pod.node.address}
    env = {v["name"]: downward[v["valueFrom"]["fieldRef"]["fieldPath"]]
           if "fieldRef" in v["valueFrom"]
           else CONFIG["data"][v["valueFrom"]["configMapKeyRef"]["key"]]
           for v in CONTAINER["env"]}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in args]


def _start(pod: Pod, hosts: Path | None) -> None:
    """The container's command and args, behind the node's network. With ``hosts``, in a
    mount namespace of the pod's own: /etc/hosts replaced by ``hosts``, the emptyDir of medium
    Memory a tmpfs sized to the memory limit (as the kubelet sizes it); without, in this
    machine's mount namespace, the emptyDir a plain directory."""
    own = []
    if hosts is not None:
        cache = pod.path(next(m["mountPath"] for m in CONTAINER["volumeMounts"]
                              if "emptyDir" in VOLUMES[m["name"]]))
        size = CONTAINER["resources"]["limits"]["memory"].removesuffix("i")
        own = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               f'mount --bind {hosts} /etc/hosts && mount -t tmpfs -o size={size} pod-cache '
               f'{cache} && exec "$@"', "pod"]
    argv = [*pod.node.enter(), *own, *pod.command(CONTAINER["command"]),
            *pod.command(_expanded(CONTAINER["args"], pod))]
    with open(pod.log, "ab") as log:
        pod.process = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True,
                                       env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})


def _wait_ready(pod: Pod) -> None:
    """The readiness probe's command, until it passes (as the kubelet runs it)."""
    deadline = time.monotonic() + START_WAIT
    probe = CONTAINER["readinessProbe"]["exec"]["command"]
    while (result := pod.run(probe)).returncode != 0:
        assert pod.process.poll() is None, f"the pod exited: {pod.log.read_text()}"
        assert time.monotonic() < deadline, f"not ready: {result.stderr}{pod.log.read_text()}"
        time.sleep(0.2)


def _stop(pod: Pod) -> None:
    """The preStop hook, then whatever it left: SIGTERM, SIGKILL (the mount namespace goes
    with the process, and the mount with it)."""
    if pod.process is None or pod.process.poll() is not None:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        pod.run(CONTAINER["lifecycle"]["preStop"]["exec"]["command"])
    for sig, wait in ((None, 10), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                pod.process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.process.wait(wait)
            return


@contextlib.contextmanager
def daemonset(tmp_path: Path, nodes: int, daemon_logs: list[Path]) -> Iterator[list[Pod]]:
    """``nodes`` nodes, each holding the same dataset, each running the DaemonSet's pod; the
    pods stopped as Kubernetes stops them when the block ends."""
    dataset = _dataset(tmp_path, 40)
    secret = base64.b64encode(os.urandom(32)) + b"\n"  # head -c 32 /dev/urandom | base64
    with cluster_network(nodes, link=None) as net:
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{n.address} {_peers_name()}\n" for n in net))
        pods = [Pod(n, tmp_path / f"node{i}", tmp_path / f"node{i}.log")
                for i, n in enumerate(net)]
        daemon_logs.extend(p.log for p in pods)
        try:
            for pod in pods:
                _volumes(pod, dataset, secret)
                _start(pod, hosts)
            for pod in pods:
                _wait_ready(pod)
            yield pods
        finally:
            for pod in pods:
                _stop(pod)


def _dataset(tmp_path: Path, files: int) -> Path:
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    make_dataset(dataset, files)
    return dataset


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file())


def _status(pod: Pod) -> dict[str, Any]:
    return json.loads(pod.run(["coordlfs", "stats", "--json", MOUNTPOINT]).stdout)


def test_daemonset_pods_mount_and_serve_each_other(tmp_path: Path, daemon_logs) -> None:
    with daemonset(tmp_path, 2, daemon_logs) as pods:
        for probe in ("startupProbe", "livenessProbe"):
            assert pods[0].run(CONTAINER[probe]["exec"]["command"]).returncode == 0
        # the example Job's script, in the first pod's namespaces (the node's mount)
        (job,) = JOB["spec"]["template"]["spec"]["containers"]
        command = [sys.executable if a == "python3" else a for a in job["command"]]
        mountpoint = pods[0].path(MOUNTPOINT)
        command[-1] = command[-1].replace(f'"{MOUNTPOINT}"', json.dumps(mountpoint))
        result = subprocess.run([*pods[0].enter(), *command], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        files = _files(tmp_path / "dataset")
        assert re.search(rf"^epoch 1: {files} files, \d+ bytes", result.stdout, re.MULTILINE)
        assert "hits" in result.stdout  # its `coordlfs stats`
        # the second node reads everything: what the first one caches comes from its memory
        walk = ("import os, sys\nfor d, _, names in os.walk(sys.argv[1]):\n"
                "    for n in names: open(os.path.join(d, n), 'rb').read()\n")
        reread = pods[1].run([sys.executable, "-c", walk, MOUNTPOINT])
        assert reread.returncode == 0, reread.stderr
        first, second = _status(pods[0]), _status(pods[1])
        addresses = {f"{p.node.address}:{SERVICE['spec']['ports'][0]['port']}" for p in pods}
        assert set(second["peers"]["nodes"]) == addresses  # from the Service's name
        assert second["peers"]["self"] == f"{pods[1].node.address}:7878"
        # each file from storage once, by its owner: the first node's misses, and the second
        # node's own files, which it cached serving the first, hits
        assert first["reads"]["file_misses"] + second["reads"]["file_hits"] == files
        assert second["reads"]["file_misses"] == 0
        assert second["reads"]["bytes_from_peers"] > 0
        # the port the annotations tell Prometheus to scrape
        port = DAEMONSET["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]
        scrape = ("import urllib.request, sys\nsys.stdout.write(urllib.request.urlopen("
                  f"'http://{pods[0].node.address}:{port}/metrics', timeout=10).read().decode())")
        metrics = pods[1].run([sys.executable, "-c", scrape])
        assert 'coordlfs_read_bytes_total{from="cache"}' in metrics.stdout, metrics.stderr
    for pod in pods:  # the preStop hook unmounted and the daemon exited
        assert pod.process.returncode == 0, pod.log.read_text()


def test_restarted_container_replaces_a_dead_mount(tmp_path: Path, daemon_logs) -> None:
    """A daemon killed outright (OOM, SIGKILL) leaves a dead FUSE mount on the node, which
    `coordlfs mount` refuses; the container's command, run again as the kubelet restarts it,
    unmounts it first. Here the pod shares this machine's mount namespace, as the mountpoint's
    volume shares the node's (Bidirectional), so that the dead mount outlives the process."""
    dataset = _dataset(tmp_path, 4)
    with cluster_network(1, link=None) as (node,):
        pod = Pod(node, tmp_path / "node", tmp_path / "node.log")
        daemon_logs.append(pod.log)
        _volumes(pod, dataset, base64.b64encode(os.urandom(32)))
        mountpoint = Path(pod.path(MOUNTPOINT))
        try:
            for run in ("first", "restarted"):
                _start(pod, hosts=None)
                _wait_ready(pod)
                if run == "first":
                    pod.process.kill()
                    pod.process.wait(10)
                    with pytest.raises(OSError):  # dead: "transport endpoint not connected"
                        os.listdir(mountpoint)
            assert sorted(os.listdir(mountpoint)) == sorted(os.listdir(dataset))
        finally:
            pid = pod.process.pid if pod.process and pod.process.poll() is None else None
            stop_daemon(mountpoint, pid)
            unmount_if_mounted(mountpoint)
