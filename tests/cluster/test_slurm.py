"""Slurm's Prolog and Epilog (mount/slurm/coordlfs-slurm) against a real Slurm on this machine.

The test starts munged, slurmctld and two slurmd (nodes 127.0.0.2 and 127.0.0.3, see
coordlfs.testbed.slurm) with the script as Prolog and Epilog, submits real jobs with srun, and
stops every daemon by pid at the end. Each job gets a coordlfs mount per node whose peers are
the allocation's nodes (--peers-from slurm), listening on the node's own address.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import OTHER_UID, digests, force_unmount, make_dataset

from coordlfs.control import Control
from coordlfs.system.mounts import mount_at, mounts
from coordlfs.system.processes import process_alive, wait_exit
from coordlfs.testbed.slurm import SlurmCluster, missing_programs, slurm_cluster

HERE = Path(__file__).parent
SCRIPT = HERE.parents[1] / "mount" / "slurm" / "coordlfs-slurm"
JOB = HERE / "slurm_job.py"
NODES = ("127.0.0.2", "127.0.0.3")
#: Ports for the jobs' daemons: the job id modulo this picks one (jobs sharing a node differ).
PORTS = 16
#: Seconds a job of a few dozen small files may take, prolog and epilog included.
JOB_TIMEOUT = 120

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmd and FUSE mounts need root"),
    pytest.mark.skipif(bool(missing_programs()), reason=f"Slurm or munge not installed "
                       f"({', '.join(missing_programs())} missing; scripts/setup installs "
                       "slurm-wlm and munge)"),
]


@dataclass(slots=True)
class Site:
    """The cluster and what its prolog mounts: coordlfs-slurm's settings for this test."""

    cluster: SlurmCluster
    directory: Path
    source: Path
    secret: Path
    settings: dict[str, str]

    def path(self, key: str, job: str, node: str) -> Path:
        return Path(self.settings[key].replace("%j", job).replace("%n", node))

    def port(self, job: str) -> int:
        """Where the job's daemons listen: PORT_BASE + job id % PORT_COUNT."""
        return int(self.settings["PORT_BASE"]) + int(job) % int(self.settings["PORT_COUNT"])

    def script_env(self, job: str, node: str) -> dict[str, str]:
        """What slurmd gives its Prolog and Epilog, for running the script by hand."""
        return {**self.cluster.env, "SLURM_JOB_ID": job, "SLURMD_NODENAME": node,
                "SLURM_NODELIST": node, "COORDLFS_SLURM_CONF": str(self.directory / "conf")}

    def left_behind(self) -> dict[str, int | None]:
        """coordlfs mounts and daemons of this site that outlived their jobs: mountpoint ->
        daemon pid (None: a mount without its daemon)."""
        ours = str(self.directory)
        found: dict[str, int | None] = {
            m.mountpoint: None for m in mounts() if m.mountpoint.startswith(ours)}
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = os.fsdecode(cmdline.read_bytes()).split("\0")
            except OSError:
                continue
            # argv: [..., "coordlfs.daemon.detached", ..., mountpoint, ""]
            if "coordlfs.daemon.detached" in argv and argv[-2].startswith(ours):
                found[argv[-2]] = int(cmdline.parent.name)
        return found


def free_ports(hosts: tuple[str, ...], count: int) -> int:
    """The first of ``count`` ports free on every host, below the ephemeral range (where the
    ports other tests bind to port 0 come from)."""
    for _ in range(100):
        base = random.randrange(20000, 30000 - count)
        try:
            for host, port in itertools.product(hosts, range(base, base + count)):
                with socket.socket() as probe:
                    probe.bind((host, port))
        except OSError:
            continue
        return base
    raise AssertionError(f"no {count} free ports in a row")


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    # Not under pytest's tmp_path (mode 700): the job run as another user reaches its mount.
    directory = Path(tempfile.mkdtemp(prefix="coordlfs-slurm-", dir="/tmp"))
    directory.chmod(0o755)
    built = None
    try:
        source = directory / "data"
        source.mkdir()
        make_dataset(source, 40)
        secret = directory / "secret"
        secret.write_bytes(base64.b64encode(os.urandom(32)))
        secret.chmod(0o600)
        settings = {
            "SOURCE": str(source),
            "MOUNTPOINT": f"{directory}/mnt/%n/%j",  # two nodes share this machine: %n too
            "CACHE_DIR": f"/dev/shm/coordlfs-0/test-slurm-{os.getpid()}-%j-%n",
            "LISTEN": "%n",  # each node's daemon on its own loopback address
            "PORT_BASE": str(free_ports(NODES, PORTS)),
            "PORT_COUNT": str(PORTS),
            "CACHE_SIZE": "64M",
            "SECRET_FILE": str(secret),
            "LOG": f"{directory}/logs/%j-%n.log",
            "STATE_DIR": f"{directory}/state",
            "COORDLFS": f"{sys.executable} -m coordlfs",
        }
        (directory / "conf").write_text("# written by test_slurm\n" + "".join(
            f"{key}={value}\n" for key, value in settings.items()))
        # Prolog= takes no arguments nor environment: a wrapper names the config.
        wrapper = directory / "coordlfs-slurm"
        wrapper.write_text(
            f"#!/bin/sh\nCOORDLFS_SLURM_CONF={directory}/conf exec {SCRIPT} \"$@\"\n")
        wrapper.chmod(0o755)
        with slurm_cluster(directory / "cluster", NODES, wrapper, wrapper) as cluster:
            built = Site(cluster, directory, source, secret, settings)
            yield built
        assert not built.left_behind()
    finally:
        for mountpoint, pid in (built.left_behind() if built else {}).items():
            force_unmount(mountpoint, pid)
        shutil.rmtree(directory)


def srun(site: Site, *argv: str, nodes: tuple[str, ...] = NODES) -> subprocess.CompletedProcess:
    return site.cluster.run("srun", f"--nodelist={','.join(nodes)}", f"--nodes={len(nodes)}",
                            "--ntasks-per-node=1", *argv, timeout=JOB_TIMEOUT)


def job_argv(site: Site, out: Path, mode: str) -> tuple[str, ...]:
    return sys.executable, str(JOB), site.settings["MOUNTPOINT"], str(out), mode


def assert_gone(site: Site, job: str, node: str, pid: int) -> None:
    """After the epilog: no mount, no daemon, no mountpoint, no cache, no note."""
    assert mount_at(str(site.path("MOUNTPOINT", job, node))) is None
    assert not process_alive(pid)
    assert not site.path("MOUNTPOINT", job, node).exists()
    assert not site.path("CACHE_DIR", job, node).exists()
    assert not (site.directory / "state" / f"job-{job}-{node}").exists()


def test_job_reads_the_dataset_through_mounts_that_use_each_other(
        site: Site, tmp_path: Path, daemon_logs: list[Path]) -> None:
    result = srun(site, *job_argv(site, tmp_path, "read"))
    assert result.returncode == 0, result.stderr
    read = {node: json.loads((tmp_path / f"{node}.json").read_text()) for node in NODES}
    job = read[NODES[0]]["job"]
    daemon_logs.extend(site.path("LOG", job, node) for node in NODES)
    expected = digests(site.source)
    port = site.port(job)
    nodes = [f"{node}:{port}" for node in NODES]
    for node, found in read.items():
        assert found["digests"] == expected, node
        peers = found["status"]["peers"]
        assert (peers["source"], peers["nodes"]) == ("slurm", nodes), node
        assert peers["self"] == f"{node}:{port}"
    assert sum(found["status"]["reads"]["bytes_from_peers"] for found in read.values()) > 0
    site.cluster.wait_jobs_over()
    for node, found in read.items():
        assert_gone(site, job, node, found["status"]["pid"])


def test_two_jobs_on_a_node_have_their_own_mounts_and_a_killed_one_leaves_none(
        site: Site, tmp_path: Path, daemon_logs: list[Path]) -> None:
    node = NODES[0]
    held, second = tmp_path / "held", tmp_path / "second"
    held.mkdir()
    second.mkdir()
    step = site.cluster.popen("srun", f"--nodelist={node}", "--nodes=1",
                              *job_argv(site, held, "hold"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        holding = held / f"{node}.holding"
        deadline = time.monotonic() + JOB_TIMEOUT
        while not holding.exists():
            assert step.poll() is None, step.communicate()[1]
            assert time.monotonic() < deadline, "the job never opened a file"
            time.sleep(0.1)
        job = holding.read_text()
        daemon_logs.append(site.path("LOG", job, node))
        first = Control(site.path("MOUNTPOINT", job, node))
        pid = first.status()["pid"]

        result = srun(site, *job_argv(site, second, "read"), nodes=(node,))
        assert result.returncode == 0, result.stderr
        other = json.loads((second / f"{node}.json").read_text())
        daemon_logs.append(site.path("LOG", other["job"], node))
        assert other["digests"] == digests(site.source)
        assert other["status"]["peers"]["self"] != first.status()["peers"]["self"]
        site.cluster.wait_jobs_over(keep={job})
        assert first.status()["pid"] == pid  # the other job's epilog left this mount alone

        site.cluster.run("scancel", job)
        step.communicate(timeout=JOB_TIMEOUT)
    finally:
        step.kill()
        step.wait()
    site.cluster.wait_jobs_over()
    assert_gone(site, job, node, pid)
    assert_gone(site, other["job"], node, other["status"]["pid"])


def script(action: str, env: dict[str, str]) -> None:
    """coordlfs-slurm run by hand as slurmd would run it; it must succeed."""
    done = subprocess.run([SCRIPT, action], env=env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr


def test_a_job_of_another_user_reads_its_mount(site: Site) -> None:
    """The prolog runs as root; the job as its user (the mount allows other users)."""
    node = NODES[1]
    out = site.directory / f"out-{OTHER_UID}"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    mountpoint = site.settings["MOUNTPOINT"].replace("%j", "$SLURM_JOB_ID").replace(
        "%n", "$SLURMD_NODENAME")
    result = site.cluster.run(
        "sbatch", "--wait", f"--uid={OTHER_UID}", f"--gid={OTHER_UID}", f"--nodelist={node}",
        "--chdir=/", f"--output={out}/%j.out", "--parsable",
        f"--wrap=id -u; cd {mountpoint} && find . -type f -exec sha256sum {{}} +",
        timeout=JOB_TIMEOUT)
    job = result.stdout.strip().split(";")[0]
    output = (out / f"{job}.out").read_text()
    assert result.returncode == 0, result.stderr + output
    uid, *lines = output.splitlines()
    assert uid == str(OTHER_UID)
    read = {path.removeprefix("./"): digest for digest, path in (
        line.split(maxsplit=1) for line in lines)}
    assert read == {str(p.relative_to(site.source)): hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in site.source.rglob("*") if p.is_file()}
    site.cluster.wait_jobs_over()
    assert not site.left_behind()


def test_prolog_and_epilog_run_twice_do_no_harm(site: Site, daemon_logs: list[Path]) -> None:
    job, node = "900001", NODES[1]
    env = site.script_env(job, node)
    daemon_logs.append(site.path("LOG", job, node))
    mountpoint = site.path("MOUNTPOINT", job, node)
    try:
        script("prolog", env)
        pid = Control(mountpoint).status()["pid"]
        script("prolog", env)
        assert Control(mountpoint).status()["pid"] == pid  # the same mount, not a second one
    finally:
        script("epilog", env)
        script("epilog", env)
    assert_gone(site, job, node, pid)


def test_a_killed_daemon_is_mounted_afresh_and_cleaned_up(site: Site,
                                                          daemon_logs: list[Path]) -> None:
    job, node = "900002", NODES[0]
    env = site.script_env(job, node)
    daemon_logs.append(site.path("LOG", job, node))
    mountpoint = site.path("MOUNTPOINT", job, node)

    def kill_daemon() -> int:
        pid = Control(mountpoint).status()["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_exit(pid, JOB_TIMEOUT)
        return pid

    try:
        script("prolog", env)
        dead = kill_daemon()
        script("prolog", env)  # a dead mount is replaced
        assert Control(mountpoint).status()["pid"] != dead
        pid = kill_daemon()  # and the epilog cleans up after a daemon that died
        assert site.path("CACHE_DIR", job, node).exists()
    finally:
        script("epilog", env)
    assert_gone(site, job, node, pid)


def fails_with(site: Site, node: str, message: str) -> None:
    """A job on ``node`` fails at its prolog, which says ``message`` in slurmd's log; the node,
    drained by the failure, is resumed."""
    logged = len(site.cluster.slurmd_log(node))
    try:
        result = srun(site, "true", nodes=(node,))
        assert result.returncode != 0
        assert "Prolog failure" in result.stderr, result.stderr
        said = site.cluster.slurmd_log(node)[logged:]
        assert "prolog failed" in said and message in said, said
    finally:
        site.cluster.wait_jobs_over()
        site.cluster.resume()
        site.cluster.wait_idle()
    assert not site.left_behind()


def test_a_secret_others_can_read_fails_the_job(site: Site) -> None:
    site.secret.chmod(0o644)
    try:
        fails_with(site, NODES[1], f"secret file {site.secret} has owner uid 0 and mode 644; "
                   "it must be root's, mode 600 at most")
    finally:
        site.secret.chmod(0o600)


def test_a_mount_that_cannot_be_made_fails_the_job(site: Site) -> None:
    node = NODES[0]
    with contextlib.ExitStack() as stack:  # every port a job may get is in use on its node
        for port in range(site.port("0"), site.port("0") + PORTS):
            taken = stack.enter_context(socket.socket())
            # SO_REUSEADDR: the earlier jobs' connections may still be in TIME_WAIT there
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind((node, port))
            taken.listen()
        fails_with(site, node, f"cannot mount {site.source} on ")
