"""Seed-aligned groups of jobs and their step profiles, kept by the daemon.

Co-located jobs that each shuffle one dataset with their own seed read it in unrelated orders
and thrash any cache. A group hands every member one seed, so members read each epoch in the
same order (``coordlfs.protocol.order``); the mount can then keep an item that one member fetched
until the others have read it (``coordlfs.jobs.window``). A member is a process (the training
script); its DataLoader workers are its descendants, so a read is attributed to a member by
walking up the reader's parent processes. A member whose process died is dropped at the next
reap, so it never pins anything.

Profiles are what the stall profiler (``coordlfs.torch``) reports per job and epoch: steps,
seconds waiting for data, seconds computing, and the jobs that shared a group with it during
the epoch: so the mount tells a run alone from one beside a partner, the two calibrations
``coordlfs stagger`` needs (``W`` and ``W|conc``).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from coordlfs.jobs import membership
from coordlfs.jobs.membership import Memberships, job_name
from coordlfs.protocol.order import SEED_LIMIT, epoch_order
from coordlfs.protocol.spec import Caller, RequestError, Served
from coordlfs.system.processes import parent_pid, process_alive

#: How far up the process tree a reader is looked for: the job, its DataLoader workers, and
#: helper processes of those.
ANCESTRY_DEPTH = 4
#: Reader pids remembered; a shell loop of short-lived readers must not grow it for ever.
MAX_READERS = 4096


@dataclass(slots=True)
class EpochProfile:
    steps: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    #: the jobs that shared a group with this one during the epoch: none for a job measured
    #: alone (the stagger model's ``W``), the partner for ``W|conc``
    partners: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Member(membership.Member):
    joined: float
    #: the epoch the member said it started (``group.epoch``), and the furthest position in
    #: that epoch's order it has opened
    epoch: int = -1
    position: int = -1
    #: the jobs of the other members seen since this member's epoch began
    partners: set[str] = field(default_factory=set)
    #: the part of the file list this member has sent (``group.files``) while incomplete
    pending_files: list[bytes] = field(default_factory=list, repr=False)


@dataclass(slots=True)
class Group(membership.Group[Member]):
    seed: int
    #: the dataset's files (paths relative to the mount), as the members index them; the
    #: order of an epoch is ``epoch_order(seed, epoch, len(files))`` over this list
    files: list[bytes] = field(default_factory=list)
    total_files: int | None = None
    index: dict[bytes, int] = field(default_factory=dict)
    #: the leading epoch, its order, and each file's position in it
    epoch: int = -1
    order: list[int] = field(default_factory=list)
    position_of: list[int] = field(default_factory=list)

    @property
    def has_order(self) -> bool:
        return self.total_files is not None and len(self.files) == self.total_files

    def lead(self) -> int:
        """The furthest position any member reached in the leading epoch."""
        return max((m.position for m in self.members.values() if m.epoch == self.epoch),
                   default=-1)


def _public(member: Member) -> dict[str, Any]:
    public = {k: v for k, v in asdict(member).items() if k != "pending_files"}
    public["partners"] = sorted(member.partners)
    return public


class Groups(Memberships[Group, Member]):
    def __init__(self, alive: Callable[[int], bool] = process_alive) -> None:
        super().__init__(alive)
        self.profiles: dict[tuple[str, int], dict[int, EpochProfile]] = {}
        #: reader pid -> member (or None); cleared when membership changes
        self._readers: dict[int, Member | None] = {}
        #: called with each member that leaves or dies (the read window drops its claims)
        self.on_leave: list[Callable[[Member], None]] = []
        #: called after a member joins or leaves (the request lane: coordlfs.fs.opens)
        self.on_change: list[Callable[[], None]] = []

    # -- membership -------------------------------------------------------------------

    def join(self, name: str, pid: int, job: str, seed: int | None,
             uid: int | None = None) -> Member:
        """Add ``pid`` (a process of ``uid``, default the daemon's) to group ``name``."""
        uid = os.getuid() if uid is None else uid
        group = self.group_to_join(name, pid, uid)
        if group is None:
            group = Group(name, uid, secrets.randbelow(SEED_LIMIT) if seed is None else seed)
        elif seed is not None and seed != group.seed:
            raise RequestError(f"group {name!r} has seed {group.seed}; join without a seed "
                               "to take it")
        member = Member(self.new_id(), name, pid, job, uid, time.time())
        for other in group.members.values():
            other.partners.add(job)
        self.enrol(group, member)
        self._readers.clear()
        for changed in self.on_change:
            changed()
        return member

    def leave(self, member_id: int) -> None:
        member, group = self.unenrol(member_id)
        if not group.members:
            del self.groups[member.group]
        self._readers.clear()
        for callback in self.on_leave:
            callback(member)
        for changed in self.on_change:
            changed()

    def reap(self) -> list[Member]:
        """Drop members whose process is gone; returns them."""
        dead = self.dead()
        for member in dead:
            self.leave(member.id)
        return dead

    def member_for_reader(self, pid: int) -> Member | None:
        """The member a reading process belongs to: the member itself or a descendant."""
        if not self.members:
            return None
        if pid in self._readers:
            return self._readers[pid]
        by_pid = {m.pid: m for m in self.members.values()}
        found, current = None, pid
        for _ in range(ANCESTRY_DEPTH):
            if current in by_pid:
                found = by_pid[current]
                break
            parent = parent_pid(current)
            if parent is None or parent <= 1:
                break
            current = parent
        if len(self._readers) >= MAX_READERS:
            self._readers.clear()
        self._readers[pid] = found
        return found

    def others(self, member: Member) -> set[int]:
        """The ids of the other members of ``member``'s group (none once it has left)."""
        group = self.groups.get(member.group)
        if group is None or member.id not in group.members:
            return set()
        return {i for i in group.members if i != member.id}

    # -- the order: files, epochs, positions -----------------------------------------------

    def add_files(self, member_id: int, offset: int, paths: list[bytes], total: int) -> Group:
        """Take part of the dataset's file list from one member. Members may send theirs at
        the same time, each in chunks; the first complete list becomes the group's."""
        member = self.member(member_id)
        group = self.groups[member.group]
        if group.total_files is not None and group.total_files != total:
            raise RequestError(f"group {group.name!r} has {group.total_files} files, not "
                               f"{total}")
        if group.has_order:
            member.pending_files = []
            return group  # another member registered it already
        if offset != len(member.pending_files):
            raise RequestError(f"expected files from offset {len(member.pending_files)}, got "
                               f"{offset}")
        if offset + len(paths) > total:
            raise RequestError(f"more than the {total} files announced")
        member.pending_files += paths
        if len(member.pending_files) == total:
            group.files, group.total_files, member.pending_files = member.pending_files, total, []
            group.index = {}
            for i, path in enumerate(group.files):
                group.index.setdefault(path, i)
        return group

    def start_epoch(self, member_id: int, epoch: int) -> None:
        member = self.member(member_id)
        group = self.groups[member.group]
        member.epoch, member.position = epoch, -1
        member.partners = {m.job for m in group.members.values() if m.id != member.id}
        if epoch > group.epoch and group.has_order:
            group.epoch = epoch
            group.order = epoch_order(group.seed, epoch, len(group.files))
            group.position_of = [0] * len(group.files)
            for position, item in enumerate(group.order):
                group.position_of[item] = position

    def note_read(self, member: Member, path: bytes) -> bool:
        """A member opened ``path``: advance its position; True if the group's lead moved."""
        group = self.groups.get(member.group)
        if group is None or member.epoch != group.epoch or not group.position_of:
            return False
        item = group.index.get(path)
        if item is None:
            return False
        lead = group.lead()
        member.position = max(member.position, group.position_of[item])
        return member.position > lead

    # -- profiles ---------------------------------------------------------------------

    def record_profile(self, job: str, pid: int, epoch: int, steps: int, wait_s: float,
                       step_s: float) -> EpochProfile:
        profile = self.profiles.setdefault((job, pid), {}).setdefault(epoch, EpochProfile())
        for member in self.members.values():
            if member.pid == pid and member.epoch == epoch:
                profile.partners = sorted(member.partners.union(profile.partners))
        profile.steps += steps
        profile.wait_s += wait_s
        profile.step_s += step_s
        return profile

    def status(self) -> dict[str, Any]:
        return {
            "groups": {
                g.name: {"seed": g.seed, "files": g.total_files, "epoch": g.epoch,
                         "lead": g.lead(),
                         "members": [_public(m) for m in g.members.values()]}
                for g in self.groups.values()
            },
            "profiles": [
                {"job": job, "pid": pid,
                 "epochs": {str(e): asdict(p) for e, p in sorted(epochs.items())}}
                for (job, pid), epochs in self.profiles.items()
            ],
        }


def register_commands(server: Served, groups: Groups) -> None:
    """``group.*`` and ``profile`` on the control file. A job joins for one of its user's own
    processes; only the user who created a membership (or root, or the mount's owner) may send
    its files, epochs or leave."""

    def join(args: dict, caller: Caller) -> dict:
        job = job_name(args["job"], args["pid"])
        member = groups.join(args["group"], args["pid"], job, args["seed"], caller.uid)
        group = groups.groups[member.group]
        return {"group": group.name, "seed": group.seed, "member": member.id,
                "members": [_public(m) for m in group.members.values()]}

    def leave(args: dict, caller: Caller) -> dict:
        groups.leave(groups.owned(args["member"], caller))
        return {}

    def files(args: dict, caller: Caller) -> dict:
        group = groups.add_files(groups.owned(args["member"], caller), args["offset"],
                                 [os.fsencode(p) for p in args["paths"]], args["total"])
        return {"files": len(group.files), "complete": group.has_order}

    def epoch(args: dict, caller: Caller) -> dict:
        groups.start_epoch(groups.owned(args["member"], caller), args["epoch"])
        return {}

    def profile(args: dict, _caller: Caller) -> dict:
        record = groups.record_profile(args["job"], args["pid"], args["epoch"], args["steps"],
                                       args["wait_s"], args["step_s"])
        return {"profile": asdict(record)}

    server.serve("group.join", join)
    server.serve("group.leave", leave)
    server.serve("group.files", files)
    server.serve("group.epoch", epoch)
    server.serve("group.list", lambda _a, _c: groups.status())
    server.serve("profile", profile)
