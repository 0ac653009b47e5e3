"""Everything a mount is started with, resolved to concrete values before the daemon starts."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import xxhash

from coordlfs.errors import UserError
from coordlfs.sizes import physical_memory

#: Where cached bytes live by default: shared memory, like CoorDL's /dev/shm cache, in a
#: directory per user (``coordlfs.system.private_dir`` makes it or refuses one that is not theirs).
SHM_ROOT = "/dev/shm/coordlfs-{uid}"
DEFAULT_CACHE_SHARE = 0.5
#: A single file may take at most this share of the cache unless --max-file-size says else,
#: so one huge shard cannot starve the many files of a training set.
DEFAULT_MAX_FILE_SHARE = 0.25
#: Bytes the group read window may hold (daemon memory, used only while aligned groups of two
#: or more jobs read files the cache does not hold).
DEFAULT_WINDOW_SIZE = 256 << 20
#: Bytes of prepared batches prep groups may stage in shared memory (``--staging-size``).
DEFAULT_STAGING_SIZE = 2 << 30
#: Storage requests the read-ahead of an aligned group keeps in flight.
DEFAULT_PREFETCH_DEPTH = 4
#: Files the batched fill queue (``prefetch``) reads at once, each whole in one worker thread:
#: deep enough to keep an SSD's queue busy with small files (measured in
#: docs/benchmarks/batched-fills.md).
DEFAULT_FILL_DEPTH = 16
#: Seconds a peer may take to connect or answer before the reader reads local storage.
DEFAULT_PEER_TIMEOUT = 2.0
#: Seconds the kernel may trust names and attributes of a source that cannot be watched
#: (``coordlfs.fs.freshness``): how late a change there may show.
DEFAULT_REVALIDATE = 1.0


@dataclass(slots=True)
class MountConfig:
    """The values ``coordlfs.daemon.options.resolve`` settled, every one (the defaults are the
    option table's: none here, so that no default lives in two places)."""

    source: str
    mountpoint: str
    cache_size: int
    max_file_size: int
    cache_dir: str
    window_size: int
    prefetch_depth: int
    fill_depth: int
    staging_size: int
    keep_cache: bool
    #: the cache directory is a tmpfs of its own in huge pages (``coordlfs.cache.cache_tmpfs``)
    cache_tmpfs: bool
    #: FUSE passthrough for complete entries: yes, no or auto (``coordlfs.fs.passthrough``)
    passthrough: str
    #: hits answered by the request lane in C: yes, no or auto (``coordlfs.fs.lane``)
    request_lane: str
    #: threads of the request lane reading /dev/fuse (the kernel hands a request to one)
    lane_threads: int
    allow_other: bool
    log_file: str | None
    debug: bool
    #: partitioned caching: where to serve peers (HOST:PORT), every node of the cluster (the
    #: same list on each), the shared secret's file (None only with ``insecure``)
    listen: str | None
    peers: tuple[str, ...]
    #: where the nodes come from instead of ``peers``: ``slurm`` or ``dns:NAME:PORT``
    peers_from: str | None
    #: a file of nodes, re-read when it changes, instead of ``peers``
    peers_file: str | None
    secret_file: str | None
    insecure: bool
    peer_timeout: float
    #: peer connections kept open at most each way (``coordlfs.peers.budget``)
    peer_connections: int
    revalidate_s: float
    #: HOST:PORT serving Prometheus metrics, or None
    metrics: str | None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> MountConfig:
        """The config ``to_json`` wrote: how the detached daemon receives the values its parent
        resolved (and printed), instead of parsing and resolving options a second time."""
        values = json.loads(text)
        return cls(**{**values, "peers": tuple(values["peers"])})


def default_cache_dir(source: str) -> str:
    """One directory per source and user, so a restarted daemon over the same source finds it
    warm."""
    real = os.path.realpath(source)
    name = os.path.basename(real.rstrip("/")) or "root"
    return os.path.join(SHM_ROOT.format(uid=os.geteuid()),
                        f"{name}-{xxhash.xxh64_hexdigest(os.fsencode(real))}")


def default_cache_size() -> int:
    return int(physical_memory() * DEFAULT_CACHE_SHARE)


def default_log_file(mountpoint: str) -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    if not os.path.isabs(state):  # no HOME, and no home in the password database
        raise UserError(f"no directory for the default log file ({state}); give --log FILE")
    escaped = os.path.realpath(mountpoint).strip("/").replace("/", "-") or "root"
    return os.path.join(state, "coordlfs", f"{escaped}.log")
