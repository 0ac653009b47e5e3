"""Members of the daemon's groups: processes known by pid, one user's jobs per group.

Aligned groups (``coordlfs.jobs.groups``) and prep groups (``coordlfs.jobs.prep``) both admit a
job's process under a job name, keep it while its process lives, refuse a group to other users
(nobody may join a stranger's group to stall it) and let only the user who created a
membership, root or the mount's owner act on it. ``Memberships`` is that part, below both;
each adds what its members do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from coordlfs.protocol.spec import Caller, Refused, RequestError
from coordlfs.system.processes import process_alive


@dataclass(slots=True)
class Member:
    id: int
    #: the name of its group
    group: str
    pid: int
    job: str
    #: the uid that created the membership: only it (or root, or the mount's owner) may act
    #: on it
    uid: int


M = TypeVar("M", bound=Member)


@dataclass(slots=True)
class Group(Generic[M]):
    name: str
    #: the uid of the job that created it: a group's members are all this user's
    uid: int
    members: dict[int, M] = field(default_factory=dict, kw_only=True)


G = TypeVar("G", bound=Group[Any])


def job_name(job: str | None, pid: int) -> str:
    """A member's job name: the one it gave, else its pid's."""
    return job if job is not None else f"pid-{pid}"


class Memberships(Generic[G, M]):
    """The groups of one kind and their members, by name and by member id."""

    #: what a group and a member are called in messages
    group_noun = "group"
    member_noun = "member"

    def __init__(self, alive: Callable[[int], bool] = process_alive) -> None:
        self.groups: dict[str, G] = {}
        self.members: dict[int, M] = {}
        self._alive = alive
        self._next_id = 1

    def group_to_join(self, name: str, pid: int, uid: int) -> G | None:
        """The group ``name`` that ``pid``, a process of ``uid``, may join (None: there is
        none yet); refused when the process is gone or another user created the group."""
        if not self._alive(pid):
            raise RequestError(f"no process {pid}")
        group = self.groups.get(name)
        if group is not None and group.uid != uid:
            raise Refused(f"{self.group_noun} {name!r} belongs to another user: a group's "
                          "members are one user's jobs")
        return group

    def new_id(self) -> int:
        member_id, self._next_id = self._next_id, self._next_id + 1
        return member_id

    def enrol(self, group: G, member: M) -> None:
        self.groups[group.name] = group
        group.members[member.id] = member
        self.members[member.id] = member

    def unenrol(self, member_id: int) -> tuple[M, G]:
        """Take the member out of its group; the caller drops a group left empty."""
        member = self.member(member_id)
        group = self.groups[member.group]
        del self.members[member_id]
        del group.members[member_id]
        return member, group

    def member(self, member_id: int) -> M:
        member = self.members.get(member_id)
        if member is None:
            raise RequestError(self.missing(member_id))
        return member

    def missing(self, member_id: int) -> str:
        return f"no {self.member_noun} {member_id}"

    def owned(self, member_id: int, caller: Caller) -> int:
        """``member_id``, once ``caller`` may act on it: it created the membership, or is root
        or the mount's owner. An unknown id passes: the command says there is none."""
        found = self.members.get(member_id)
        if found is not None:
            caller.use(found.uid, f"{self.member_noun} {member_id}")
        return member_id

    def dead(self) -> list[M]:
        """The members whose process is gone."""
        return [m for m in self.members.values() if not self._alive(m.pid)]
