"""A real Slurm cluster on this machine, for tests: munged, slurmctld and one slurmd per node.

Everything lives in one temporary directory (config, munge key and socket, state, spool, logs)
and every daemon runs in the foreground as a child of the caller, so that stopping them is
stopping pids we started; nothing touches /etc, systemd or the system's munge.

Several nodes on one host: Debian's slurmd runs once per node with ``-N NAME``, each on its own
port. The nodes are named by loopback addresses (127.0.0.2, 127.0.0.3, ...): Slurm takes them
as names, ``scontrol show hostnames`` gives them back as they are, and they resolve without
/etc/hosts, so a coordlfs daemon of each node can listen on its node's own address at the port
all nodes share, as on a real cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from coordlfs.errors import UserError

#: Programs the cluster needs (Debian packages slurm-wlm, slurm-client and munge).
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "scontrol", "sinfo", "squeue", "scancel")
#: Seconds a daemon gets to come up, and to exit after SIGTERM.
START_WAIT = 30.0
STOP_WAIT = 15.0


#: Where Debian puts the daemons, on PATH or not (a non-login root shell may lack sbin).
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p, path=SEARCH_PATH) is None]


def free_port(host: str = "0.0.0.0") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_for(what: str, ready: Callable[[], bool], timeout: float = START_WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise UserError(f"{what} not ready after {timeout:.0f}s")
        time.sleep(0.1)


@dataclass(slots=True)
class SlurmCluster:
    directory: Path
    conf: Path
    nodes: tuple[str, ...]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": SEARCH_PATH, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm command (srun, scontrol, ...) against this cluster."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def popen(self, *argv: str, **kwargs) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, env=self.env, text=True, **kwargs)

    def slurmd_log(self, node: str) -> str:
        return (self.directory / "log" / f"slurmd-{node}.log").read_text(errors="replace")

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def jobs(self) -> list[str]:
        """Jobs not yet over (pending, running, or completing: their epilog still runs)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def wait_jobs_over(self, keep: Collection[str] = (), timeout: float = START_WAIT) -> None:
        """No job left but those in ``keep``: each other job's epilog has run on its nodes."""
        _wait_for("the end of Slurm's jobs", lambda: set(self.jobs()) <= set(keep), timeout)

    def idle(self) -> bool:
        """Every node registered and idle (none drained), no job left."""
        states = self.node_states()
        return not self.jobs() and len(states) == len(self.nodes) and set(
            states.values()) == {"idle"}

    def wait_idle(self, timeout: float = START_WAIT) -> None:
        _wait_for("Slurm's nodes", self.idle, timeout)

    def resume(self) -> None:
        """Nodes a failed prolog drained take jobs again."""
        for node, state in self.node_states().items():
            if state not in ("idle", "alloc", "mix"):
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")


def _config(directory: Path, nodes: Sequence[str], prolog: Path, epilog: Path) -> str:
    host = socket.gethostname().split(".")[0]  # as slurmctld compares it: short
    node_lines = "".join(f"NodeName={name} NodeHostname={host} "
                         f"Port={free_port()} CPUs=2 RealMemory=1000 State=UNKNOWN\n"
                         for name in nodes)
    return f"""\
ClusterName=coordlfstest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={directory}/munge/socket
CredType=cred/munge
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
Prolog={prolog}
Epilog={epilog}
PrologFlags=Alloc
SlurmdDebug=info
MailProg=/bin/true
{node_lines}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def slurm_cluster(directory: Path, nodes: Sequence[str], prolog: Path,
                  epilog: Path) -> Iterator[SlurmCluster]:
    """A running cluster of ``nodes`` (names that resolve: loopback addresses) whose Prolog and
    Epilog are the given programs; on exit, jobs are cancelled (their epilogs run), then
    slurmd, slurmctld and munged are stopped by pid."""
    for sub in ("munge", "state", "log"):
        (directory / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    # where a batch job's script waits for its user: open to all, as /var/spool/slurmd is
    (directory / "spool").mkdir(mode=0o755)
    key = directory / "munge" / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = directory / "slurm.conf"
    conf.write_text(_config(directory, nodes, prolog, epilog))
    cluster = SlurmCluster(directory, conf, tuple(nodes))
    started: dict[str, subprocess.Popen[bytes]] = {}  # by name, in the order started

    def start(name: str, *argv: str) -> None:
        with open(directory / "log" / f"{name}.out", "wb") as out:
            started[name] = subprocess.Popen(argv, env=cluster.env, stdout=out, stderr=out,
                                             stdin=subprocess.DEVNULL)

    def running(ready: Callable[[], bool]) -> bool:
        """``ready()``, or an error with a daemon's last words if it died."""
        for name, process in started.items():
            if process.poll() is not None:
                said = (directory / "log" / f"{name}.out").read_text(errors="replace")
                raise UserError(f"{name} exited ({process.returncode}): {said[-2000:]}")
        return ready()

    try:
        munge = directory / "munge"
        # -F: in the foreground; --force: the socket's directory is under /tmp (world-writable)
        start("munged", "munged", "-F", "--force", f"--socket={munge}/socket",
              f"--key-file={key}", f"--log-file={munge}/log", f"--pid-file={munge}/pid",
              f"--seed-file={munge}/seed")
        _wait_for("munged", lambda: running((munge / "socket").exists))
        start("slurmctld", "slurmctld", "-D", "-f", str(conf))
        _wait_for("slurmctld", lambda: running(
            lambda: cluster.run("scontrol", "ping").returncode == 0))
        for name in nodes:
            start(f"slurmd-{name}", "slurmd", "-D", "-N", name, "-f", str(conf))
        _wait_for("slurmd", lambda: running(cluster.idle))
        yield cluster
    finally:
        with contextlib.suppress(UserError, subprocess.TimeoutExpired, OSError):
            # jobs left by a failed test: their epilogs run before slurmd stops
            if any(name.startswith("slurmd-") for name in started) and cluster.jobs():
                cluster.run("scancel", "--full", *cluster.jobs())
                cluster.wait_jobs_over()
        for process in reversed(started.values()):
            process.terminate()
            try:
                process.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
