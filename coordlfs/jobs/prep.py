"""Prep-sharing: the daemon's side of coordinated pre-processing across separately launched jobs.

Hyper-parameter search runs several jobs over the same data; each would fetch and pre-process
(decode, crop, flip) every item itself. A prep group splits each epoch's batches among its
jobs instead (CoorDL's coordinated prep): a job *claims* a batch, prepares it with its own
workers, *reserves* its bytes in the staging area, writes it to a file there (shared memory)
and *publishes* it; every job of the epoch is handed every published batch once (``next``),
in an order of its own, and the batch file is deleted as soon as all of them have used it.

The daemon only keeps the books; the bytes go from producer to consumers through tmpfs files
that consumers map, never through the FUSE data path. The daemon owns the files' lifetime:
it deletes a batch once every member used it, an epoch's directory when the epoch ends, and a
group's when its last member is gone, so nothing is left in shared memory even when every job
was killed with ``kill -9``.

Epochs are the unit of membership. A job that joins while an epoch runs waits for the next
one (``epoch`` answers ``wait``); an epoch starts once every member asked for it and at least
``min_members`` did, or once the first asker waited a hang timeout for the rest. A member
whose process died is dropped at once; one that sent no request for longer than its hang
timeout (``hang_factor`` times its measured time per batch, at least the group's floor) is
expelled. Either way its claimed but unpublished batches go back to the pool for the others
to prepare, and no batch waits for it any longer.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import random
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordlfs.errors import UserError
from coordlfs.jobs import membership
from coordlfs.jobs.membership import Memberships, job_name
from coordlfs.protocol.order import SEED_LIMIT, batch_count
from coordlfs.protocol.spec import Caller, RequestError, Served
from coordlfs.system.private_dir import open_private
from coordlfs.system.processes import process_alive

log = logging.getLogger(__name__)

#: Where staging directories live: tmpfs, so a staged batch is memory that consumers map; a
#: directory per user, made or checked by ``coordlfs.system.private_dir`` (nobody else may write
#: there).
STAGING_ROOT = "/dev/shm/coordlfs-prep-{uid}"
#: A member is expelled after this many times its measured seconds per batch without a request.
HANG_FACTOR = 20.0
#: Weight of the newest interval in a member's running mean seconds per batch.
EWMA_WEIGHT = 0.2


@dataclass(slots=True)
class Staged:
    path: str
    bytes: int
    producer: int
    #: members that have not yet been handed the batch, and those handed it who have not
    #: acknowledged it: the file goes when both are empty
    unseen: set[int]
    using: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Epoch:
    number: int
    directory: str
    members: set[int]
    unclaimed: list[int]
    claims: dict[int, int] = field(default_factory=dict)
    #: batch -> bytes reserved by its claimant for the file it is about to write
    reserved: dict[int, int] = field(default_factory=dict)
    staged: dict[int, Staged] = field(default_factory=dict)
    released: int = 0


@dataclass(slots=True)
class PrepMember(membership.Member):
    """A job in a prep group; its reservations count against its uid's share of the staging
    area."""

    last_seen: float
    #: a request of this member waits at the mount for its answer until then: a member that
    #: waits for the mount is not hung
    waiting_until: float = 0.0
    #: asked for its next epoch and waits for the group to start it
    waiting_since: float | None = None
    epoch: int | None = None
    consumed: int = 0
    prepared: int = 0
    #: running mean seconds between the batches it was handed (its step time)
    batch_s: float | None = None
    last_handed: float | None = None
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "job": self.job, "pid": self.pid, "uid": self.uid,
                "epoch": self.epoch,
                "consumed": self.consumed, "prepared": self.prepared,
                "batch_s": None if self.batch_s is None else round(self.batch_s, 6),
                "waiting": self.waiting_since is not None}


@dataclass(slots=True)
class PrepGroup(membership.Group[PrepMember]):
    number: int
    samples: int
    batch_size: int
    drop_last: bool
    min_members: int
    hang_floor_s: float
    #: the seed of the batches' order: epoch e's batches are
    #: ``coordlfs.protocol.order.epoch_order(seed, e, samples)`` cut into ``batch_size`` pieces
    seed: int
    epoch: Epoch | None = None
    last_epoch: int = -1

    @property
    def batches(self) -> int:
        return batch_count(self.samples, self.batch_size, self.drop_last)


class Prep(Memberships[PrepGroup, PrepMember]):
    """Every prep group of the mount, their epochs, and the staging area's bound."""

    group_noun = "prep group"
    member_noun = "prep member"

    def __init__(self, capacity: int, root: str | None = None,
                 alive: Callable[[int], bool] = process_alive,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(alive)
        self.capacity = capacity
        self.directory = _own_directory(STAGING_ROOT.format(uid=os.geteuid())
                                        if root is None else root)
        self.used = 0
        self.peak = 0
        self.counters = {"published": 0, "released": 0, "taken_over": 0, "expelled": 0,
                         "full": 0}
        self._clock = clock
        self._next_group = 1
        #: called after each tick: time passed and members may have gone, so a waiting
        #: request may have its answer
        self.on_tick: list[Callable[[], None]] = []

    # -- membership ------------------------------------------------------------------

    def join(self, name: str, pid: int, job: str, samples: int, batch_size: int,
             drop_last: bool, min_members: int, hang_floor_s: float,
             uid: int | None = None) -> PrepMember:
        """Add ``pid`` (a process of ``uid``, default the daemon's) to prep group ``name``."""
        uid = os.getuid() if uid is None else uid
        group = self.group_to_join(name, pid, uid)
        if group is None:
            group = PrepGroup(name, uid, self._next_group, samples, batch_size, drop_last,
                              min_members, hang_floor_s, secrets.randbelow(SEED_LIMIT))
            self._next_group += 1
            os.mkdir(self._group_directory(group), 0o700)  # numbers are not reused: a new one
        elif (group.samples, group.batch_size, group.drop_last) != (samples, batch_size,
                                                                     drop_last):
            raise RequestError(
                f"group {name!r} has {group.samples} samples in batches of "
                f"{group.batch_size} (drop_last {str(group.drop_last).lower()}); a job "
                "must use the same dataset, batch size and drop_last to share batches")
        group.min_members = max(group.min_members, min_members)
        member_id = self.new_id()
        member = PrepMember(member_id, name, pid, job, uid, self._clock(),
                            rng=random.Random(member_id))
        self.enrol(group, member)
        return member

    def leave(self, member_id: int, why: str = "left") -> None:
        member, group = self.unenrol(member_id)
        log.info("prep member %d (%s, pid %d) of group %s %s", member.id, member.job,
                 member.pid, group.name, why)
        epoch = group.epoch
        if epoch is not None and member_id in epoch.members:
            epoch.members.discard(member_id)
            for batch in [b for b, owner in epoch.claims.items() if owner == member_id]:
                self._unclaim(epoch, batch)
                self.counters["taken_over"] += 1
            for batch, staged in list(epoch.staged.items()):
                staged.unseen.discard(member_id)
                staged.using.discard(member_id)
                self._release_if_used(epoch, batch)
        if not group.members:
            self._end_epoch(group)
            shutil.rmtree(self._group_directory(group), ignore_errors=True)
            del self.groups[group.name]
        else:
            self._maybe_end_epoch(group)

    def tick(self) -> list[PrepMember]:
        """Drop members whose process is gone or that stopped asking; returns them."""
        now = self._clock()
        gone = self.dead()
        for member in gone:
            self.leave(member.id, "is gone")
        for member in [m for m in self.members.values() if self._hung(m, now)]:
            self.counters["expelled"] += 1
            self.leave(member.id, f"sent nothing for {now - member.last_seen:.1f} s: expelled")
            gone.append(member)
        for group in list(self.groups.values()):
            self._maybe_start_epoch(group, now)
        for callback in self.on_tick:
            callback()
        return gone

    def hang_timeout(self, member: PrepMember) -> float:
        floor = self.groups[member.group].hang_floor_s
        return floor if member.batch_s is None else max(floor, HANG_FACTOR * member.batch_s)

    def _hung(self, member: PrepMember, now: float) -> bool:
        busy = self._busy(self.groups[member.group], member)
        seen = max(member.last_seen, member.waiting_until)
        return busy and now - seen > self.hang_timeout(member)

    def waits(self, member_id: int, seconds: float) -> None:
        """A request of the member may wait up to ``seconds`` for its answer."""
        member = self.members.get(member_id)
        if member is not None:
            member.waiting_until = self._clock() + seconds

    @staticmethod
    def _busy(group: PrepGroup, member: PrepMember) -> bool:
        """In the running epoch with batches still to use (or to prepare)."""
        epoch = group.epoch
        if epoch is None or member.id not in epoch.members:
            return False
        return member.consumed < group.batches or member.id in epoch.claims.values()

    # -- epochs ----------------------------------------------------------------------

    def start_epoch(self, member_id: int) -> dict[str, Any]:
        """The member asks for its next epoch: the epoch's number once it runs, else wait."""
        member = self._seen(member_id)
        group = self.groups[member.group]
        if self._busy(group, member):
            return self._epoch_reply(group)
        if member.waiting_since is None:
            member.waiting_since = self._clock()
        self._maybe_start_epoch(group, self._clock())
        if member.waiting_since is None:  # a new epoch started with this member in it
            return self._epoch_reply(group)
        waiting = sum(m.waiting_since is not None for m in group.members.values())
        return {"wait": True, "running": group.epoch is not None, "asked": waiting,
                "members": len(group.members), "min_members": group.min_members}

    def _epoch_reply(self, group: PrepGroup) -> dict[str, Any]:
        epoch = group.epoch
        assert epoch is not None
        return {"epoch": epoch.number, "batches": group.batches,
                "members": [group.members[i].job for i in sorted(epoch.members)]}

    def _maybe_start_epoch(self, group: PrepGroup, now: float) -> None:
        if group.epoch is not None:
            return
        asked = [m for m in group.members.values() if m.waiting_since is not None]
        if not asked:
            return
        # ``min_members`` is for gathering the jobs of a search at its start; later epochs
        # go on with whoever is left
        enough = group.last_epoch >= 0 or len(asked) >= group.min_members
        everyone = len(asked) == len(group.members) and enough
        first = min(m.waiting_since for m in asked)  # type: ignore[type-var]
        if not everyone and now - first < group.hang_floor_s:
            return
        number = group.last_epoch + 1
        directory = os.path.join(self._group_directory(group), str(number))
        os.mkdir(directory, 0o700)  # epochs are not reused: a new one
        group.epoch = Epoch(number, directory, {m.id for m in asked},
                            list(range(group.batches)))
        for member in asked:
            member.waiting_since, member.epoch, member.last_seen = None, number, now
            member.last_handed, member.consumed = None, 0
        log.info("prep group %s: epoch %d with %d members", group.name, number, len(asked))

    def _maybe_end_epoch(self, group: PrepGroup) -> None:
        epoch = group.epoch
        if epoch is not None and (epoch.released == group.batches or not epoch.members):
            self._end_epoch(group)

    def _end_epoch(self, group: PrepGroup) -> None:
        epoch = group.epoch
        if epoch is None:
            return
        for batch in list(epoch.staged):
            self._release(epoch, batch)
        for batch in list(epoch.reserved):
            self._unreserve(epoch, batch)
        shutil.rmtree(epoch.directory, ignore_errors=True)
        group.epoch, group.last_epoch = None, epoch.number
        for member in group.members.values():
            if member.epoch == epoch.number:
                member.epoch = None

    # -- producing ---------------------------------------------------------------------

    def claim(self, member_id: int) -> dict[str, Any]:
        """Hand the member the lowest batch nobody prepares yet (``outstanding``: how many
        other members still prepare, whose batches may yet come back to the pool)."""
        member, epoch = self._in_epoch(member_id)
        if epoch.unclaimed:
            batch = epoch.unclaimed.pop(0)
            epoch.claims[batch] = member.id
            return {"batch": batch, "epoch": epoch.number}
        return {"batch": None, "epoch": epoch.number,
                "outstanding": sum(owner != member.id for owner in epoch.claims.values())}

    def reserve(self, member_id: int, batch: int, size: int) -> dict[str, Any]:
        """Room in the staging area for a batch the member claimed, and the file to write it
        to; ``full`` means retry once batches were published or used: the area is full, or
        the user's other reservations fill its share (``share``). A batch larger than the
        share is refused: waiting would not help."""
        member, epoch = self._in_epoch(member_id)
        self._claimed_by(epoch, batch, member)
        earlier = epoch.reserved.get(batch, 0)  # a batch may reserve again
        share = self.share(member.uid)
        if size > share:
            raise RequestError(
                f"a batch of {size} bytes does not fit this user's share of the staging area "
                f"({share} of {self.capacity} bytes, shared by the users preparing now): "
                "raise --staging-size")
        others = self.used - earlier
        if (others + size > self.capacity
                or self._reserved_by(member.uid) - earlier + size > share):
            self.counters["full"] += 1
            return {"full": True, "used_bytes": self.used, "capacity_bytes": self.capacity}
        self.used = others
        epoch.reserved[batch] = size
        self._account(size)
        return {"full": False, "path": self._batch_path(epoch, batch, member.id)}

    def publish(self, member_id: int, batch: int) -> dict[str, Any]:
        """The member wrote its reserved batch: every member of the epoch may now use it."""
        member, epoch = self._in_epoch(member_id)
        self._claimed_by(epoch, batch, member)
        if batch not in epoch.reserved:
            raise RequestError(f"batch {batch} has no room reserved (prep.reserve first)")
        path = self._batch_path(epoch, batch, member.id)
        try:
            st = os.lstat(path)
        except OSError as e:
            raise RequestError(f"batch {batch}: cannot stat {path}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise RequestError(f"batch {batch}: {path} is not a regular file")
        size = st.st_size
        reserved = epoch.reserved.pop(batch)
        self.used -= reserved
        self._account(size)
        del epoch.claims[batch]
        epoch.staged[batch] = Staged(path, size, member.id, set(epoch.members))
        member.prepared += 1
        self.counters["published"] += 1
        return {"bytes": size}

    def share(self, uid: int) -> int:
        """The most bytes one user's unpublished reservations may hold: the staging area split
        evenly among the users with members in a running epoch, so that no user (a job that
        reserves much and never publishes) can starve another's groups."""
        users = {uid} | {self.members[i].uid for g in self.groups.values()
                         if g.epoch is not None for i in g.epoch.members}
        return self.capacity // len(users)

    def _reserved_by(self, uid: int) -> int:
        """Bytes reserved, not yet published, by ``uid``'s members."""
        return sum(size for g in self.groups.values() if g.epoch is not None
                   for batch, size in g.epoch.reserved.items()
                   if self.members[g.epoch.claims[batch]].uid == uid)

    # -- consuming ---------------------------------------------------------------------

    def next(self, member_id: int, done: list[int]) -> dict[str, Any]:
        """Acknowledge the batches in ``done``; hand the member a published batch it has not
        had, chosen at random among those staged (``wait`` if none yet, ``end`` when it had
        all of them)."""
        member, epoch = self._in_epoch(member_id)
        for batch in done:
            staged = epoch.staged.get(batch)
            if staged is not None and member.id in staged.using:
                staged.using.discard(member.id)
                self._release_if_used(epoch, batch)
        group = self.groups[member.group]
        if member.consumed >= group.batches:
            reply = {"end": True, "epoch": epoch.number}
            self._maybe_end_epoch(group)
            return reply
        ready = [b for b, s in epoch.staged.items() if member.id in s.unseen]
        if not ready:
            return {"wait": True, "epoch": epoch.number}
        batch = member.rng.choice(ready)
        staged = epoch.staged[batch]
        staged.unseen.discard(member.id)
        staged.using.add(member.id)
        member.consumed += 1
        now = self._clock()
        if member.last_handed is not None:
            interval = now - member.last_handed
            member.batch_s = interval if member.batch_s is None else (
                (1 - EWMA_WEIGHT) * member.batch_s + EWMA_WEIGHT * interval)
        member.last_handed = now
        return {"batch": batch, "epoch": epoch.number, "path": staged.path,
                "bytes": staged.bytes, "producer": staged.producer}

    # -- bookkeeping -------------------------------------------------------------------

    def _account(self, size: int) -> None:
        self.used += size
        self.peak = max(self.peak, self.used)

    def _release_if_used(self, epoch: Epoch, batch: int) -> None:
        staged = epoch.staged[batch]
        if not staged.unseen and not staged.using:
            self._release(epoch, batch)
            epoch.released += 1
            self.counters["released"] += 1

    def _release(self, epoch: Epoch, batch: int) -> None:
        staged = epoch.staged.pop(batch)
        self.used -= staged.bytes
        _unlink(staged.path)

    def _unreserve(self, epoch: Epoch, batch: int) -> None:
        self.used -= epoch.reserved.pop(batch)

    def _unclaim(self, epoch: Epoch, batch: int) -> None:
        owner = epoch.claims.pop(batch)
        if batch in epoch.reserved:
            self._unreserve(epoch, batch)
        _unlink(self._batch_path(epoch, batch, owner))
        bisect.insort(epoch.unclaimed, batch)

    def _group_directory(self, group: PrepGroup) -> str:
        return os.path.join(self.directory, str(group.number))

    @staticmethod
    def _batch_path(epoch: Epoch, batch: int, member_id: int) -> str:
        return os.path.join(epoch.directory, f"{batch}-{member_id}.pt")

    def missing(self, member_id: int) -> str:
        return f"no prep member {member_id} (left, died or was expelled)"

    def _seen(self, member_id: int) -> PrepMember:
        member = self.member(member_id)
        member.last_seen = self._clock()
        return member

    def _in_epoch(self, member_id: int) -> tuple[PrepMember, Epoch]:
        member = self._seen(member_id)
        epoch = self.groups[member.group].epoch
        if epoch is None or member.id not in epoch.members:
            raise RequestError(f"prep member {member_id} is in no running epoch "
                               "(prep.epoch first)")
        return member, epoch

    @staticmethod
    def _claimed_by(epoch: Epoch, batch: int, member: PrepMember) -> None:
        if epoch.claims.get(batch) != member.id:
            raise RequestError(f"batch {batch} of epoch {epoch.number} is not claimed by "
                               f"member {member.id}")

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        return {
            "staging": {"capacity_bytes": self.capacity, "used_bytes": self.used,
                        "peak_bytes": self.peak, "directory": self.directory,
                        **self.counters},
            "groups": {g.name: _group_status(g) for g in self.groups.values()},
        }


def _group_status(group: PrepGroup) -> dict[str, Any]:
    epoch = group.epoch
    return {
        "batches": group.batches, "samples": group.samples, "batch_size": group.batch_size,
        "min_members": group.min_members, "last_epoch": group.last_epoch,
        "epoch": None if epoch is None else {
            "number": epoch.number, "members": sorted(epoch.members),
            "unclaimed": len(epoch.unclaimed), "preparing": len(epoch.claims),
            "staged": len(epoch.staged),
            "staged_bytes": sum(s.bytes for s in epoch.staged.values()),
            "released": epoch.released},
        "members": [m.public() for m in group.members.values()],
    }


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _own_directory(root: str) -> str:
    """This daemon's staging directory, made afresh in ``root`` (which must be the user's
    alone: a mount is refused over a staging area someone else could write to)."""
    try:
        staging = open_private(root, "remove it")
    except OSError as e:
        raise UserError(f"cannot use the staging area {root}: {e.strerror}") from None
    try:
        _remove_stale(staging.fd)
        os.mkdir(str(os.getpid()), 0o700, dir_fd=staging.fd)
    except OSError as e:
        raise UserError(f"cannot use the staging area {staging.path}: {e.strerror}") from None
    finally:
        os.close(staging.fd)
    return os.path.join(staging.path, str(os.getpid()))


def _remove_stale(root_fd: int) -> None:
    """Staging directories of daemons that are gone (killed before they could clean up): one
    named after this process is a former one's whose pid it got."""
    for name in os.listdir(root_fd):
        if name.isdigit() and (int(name) == os.getpid() or not process_alive(int(name))):
            shutil.rmtree(name, ignore_errors=True, dir_fd=root_fd)


def register_commands(server: Served, prep: Prep) -> None:
    """The ``prep.*`` commands on the control file. A job joins for one of its user's own
    processes; only the user who created a membership (or root, or the mount's owner) may act
    on it."""

    def join(args: dict, caller: Caller) -> dict:
        pid, samples, batch_size = args["pid"], args["samples"], args["batch_size"]
        if args["drop_last"] and samples < batch_size:
            raise RequestError('with "drop_last" there must be at least one full batch')
        member = prep.join(args["group"], pid, job_name(args["job"], pid), samples, batch_size,
                           args["drop_last"], args["min_members"], args["hang_timeout_s"],
                           caller.uid)
        group = prep.groups[member.group]
        return {"member": member.id, "group": group.name, "batches": group.batches,
                "seed": group.seed,
                "members": [m.public() for m in group.members.values()],
                "staging_capacity_bytes": prep.capacity,
                "staging_share_bytes": prep.share(caller.uid)}

    def mine(args: dict, caller: Caller) -> int:
        member_id = prep.owned(args["member"], caller)
        prep.waits(member_id, args.get("timeout_s", 0.0))
        return member_id

    def leave(args: dict, caller: Caller) -> dict:
        prep.leave(mine(args, caller))
        return {}

    server.serve("prep.join", join)
    server.serve("prep.epoch", lambda a, c: prep.start_epoch(mine(a, c)))
    server.serve("prep.claim", lambda a, c: prep.claim(mine(a, c)))
    server.serve("prep.reserve", lambda a, c: prep.reserve(mine(a, c), a["batch"], a["bytes"]))
    server.serve("prep.publish", lambda a, c: prep.publish(mine(a, c), a["batch"]))
    server.serve("prep.next", lambda a, c: prep.next(mine(a, c), a["done"]))
    server.serve("prep.leave", leave)
    server.serve("prep.list", lambda _a, _c: prep.status())
    prep.on_tick.append(server.notify)
