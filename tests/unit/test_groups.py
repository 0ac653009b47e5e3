"""Unit tests of seed-aligned groups: the shared order, the read window and the group registry."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys

import pytest
import trio

from coordlfs.jobs.groups import Groups, register_commands
from coordlfs.jobs.window import ReadWindow
from coordlfs.protocol.order import epoch_order, shard
from coordlfs.protocol.server import ControlServer


def test_order_is_shared_per_epoch_and_new_each_epoch() -> None:
    assert epoch_order(7, 0, 1000) == epoch_order(7, 0, 1000)
    assert sorted(epoch_order(7, 0, 1000)) == list(range(1000))
    assert epoch_order(7, 1, 1000) != epoch_order(7, 0, 1000)
    assert epoch_order(8, 0, 1000) != epoch_order(7, 0, 1000)
    # Pinned: the order is a protocol other languages implement (docs/design/aligned-groups.md).
    assert epoch_order(1, 0, 8) == [7, 1, 6, 4, 5, 2, 3, 0]
    assert epoch_order(2**64 - 1, 7, 5) == [2, 1, 0, 3, 4]
    assert epoch_order(3, 0, 0) == []
    with pytest.raises(ValueError):
        epoch_order(2**64, 0, 3)


def test_shard_splits_as_distributed_sampler() -> None:
    order = list(range(10))
    # padded with the head to 12, then every 4th item
    assert [shard(order, r, 4) for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert [shard(order, r, 4, drop_last=True) for r in range(4)] == [[0, 4], [1, 5], [2, 6],
                                                                     [3, 7]]
    assert shard([5], 2, 3) == [5]
    with pytest.raises(ValueError):
        shard(order, 4, 4)


def test_window_holds_until_every_member_read() -> None:
    window = ReadWindow(capacity=100)
    window.claim((1, 1))
    window.publish((1, 1), (10, 5), b"x" * 10, 9, waiting={2, 3})
    assert window.used == 10
    assert window.take((1, 1), (10, 5), 2) == b"x" * 10
    assert window.used == 10  # member 3 has not read it yet
    assert window.take((1, 1), (10, 5), 3) == b"x" * 10
    assert window.used == 0 and not window.items
    assert window.take((1, 1), (10, 5), 3) is None


def test_window_never_exceeds_its_bound_and_drops_oldest_first() -> None:
    window = ReadWindow(capacity=1000)
    rng = random.Random(1)
    for i in range(500):
        size = rng.randrange(0, 400)
        window.publish((0, i), (size, 0), b"y" * size, 9, waiting={1})
        assert window.used <= window.capacity
        assert window.used == sum(len(h.data) for h in window.items.values())
        if rng.random() < 0.3 and window.items:
            key = rng.choice(list(window.items))
            window.take(key, window.items[key].version, 1)
    window.publish((0, 1000), (10, 0), b"a" * 10, 9, waiting={1})
    window.publish((0, 1001), (995, 0), b"b" * 995, 9, waiting={1})  # pushes out the oldest
    assert (0, 1000) not in window.items and (0, 1001) in window.items
    window.publish((0, 1002), (2000, 0), b"c" * 2000, 9, waiting={1})  # larger than the window
    assert (0, 1002) not in window.items and window.used <= window.capacity


def test_window_serves_only_the_same_version_and_forgets_members() -> None:
    window = ReadWindow(capacity=100)
    window.publish((1, 1), (3, 1), b"old", 9, waiting={2})
    assert window.take((1, 1), (3, 2), 2) is None and not window.items
    window.publish((1, 2), (3, 1), b"abc", 9, waiting={2, 3})
    window.forget_member(2)
    assert window.items[(1, 2)].waiting == {3}
    window.forget_member(3)
    assert window.used == 0 and not window.items


def test_waiters_share_one_fetch() -> None:
    window = ReadWindow(capacity=100)
    got = []

    async def main() -> None:
        window.claim((1, 1))
        async with trio.open_nursery() as nursery:
            async def follower() -> None:
                await window.wait_for_fetch((1, 1))
                got.append(window.take((1, 1), (2, 0), 2))
            nursery.start_soon(follower)
            await trio.sleep(0.01)
            window.publish((1, 1), (2, 0), b"hi", 9, waiting={2})

    trio.run(main)
    assert got == [b"hi"] and not window.items


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_groups_share_a_seed_and_notice_dead_members() -> None:
    groups = Groups()
    left = []
    groups.on_leave.append(left.append)
    child = _child()
    try:
        a = groups.join("g", os.getpid(), "a", seed=None)
        b = groups.join("g", child.pid, "b", seed=None)
        assert groups.groups["g"].seed == groups.groups["g"].seed
        assert groups.others(a) == {b.id}
        with pytest.raises(Exception, match="has seed"):
            groups.join("g", os.getpid(), "c", seed=groups.groups["g"].seed ^ 1)
        assert groups.member_for_reader(os.getpid()) is a
        assert groups.member_for_reader(child.pid) is b
        grandchild_of_a = _child()  # a DataLoader worker of job a
        try:
            assert groups.member_for_reader(grandchild_of_a.pid) is a
        finally:
            grandchild_of_a.kill()
            grandchild_of_a.wait()
        child.kill()
        child.wait()
        assert groups.reap() == [b] and left == [b]
        assert groups.others(a) == set()
        groups.leave(a.id)
        assert not groups.groups and not groups.members
    finally:
        child.kill()
        child.wait()


def _ask(server: ControlServer, **request: object) -> tuple[dict, bool]:
    reply, error = server.handle(json.dumps(request).encode())
    return json.loads(reply), error == 0


def _ask_as(server: ControlServer, uid: int, **request: object) -> tuple[dict, int]:
    reply, error = server.handle(json.dumps(request).encode(), server.caller(uid, 1))
    return json.loads(reply), error


@pytest.mark.parametrize("request_, message", [
    ({"cmd": "group.join"}, '"pid" must be an integer'),
    ({"cmd": "group.join", "pid": 1, "group": ""}, '"group" must be 1 to 128'),
    ({"cmd": "group.join", "pid": 1, "group": "g\n"}, "printable"),
    ({"cmd": "group.join", "pid": 1, "group": "g", "seed": -1}, '"seed" must be in'),
    ({"cmd": "group.join", "pid": 1, "group": "g", "seed": 2**64}, '"seed" must be in'),
    ({"cmd": "group.join", "pid": -5, "group": "g"}, '"pid" must be a process id'),
    ({"cmd": "group.join", "pid": 2**22 + 12345, "group": "g"}, "no process"),
    ({"cmd": "group.join", "pid": True, "group": "g"}, '"pid" must be an integer'),
    ({"cmd": "group.leave", "member": 99}, "no member 99"),
    ({"cmd": "group.leave", "member": "1"}, '"member" must be an integer'),
    ({"cmd": "profile", "job": "j", "pid": 1, "epoch": 0, "steps": 3, "wait_s": -1,
      "step_s": 1}, '"wait_s" must be a number of seconds'),
    ({"cmd": "profile", "job": "j", "pid": 1, "epoch": -1, "steps": 3, "wait_s": 1,
      "step_s": 1}, '"epoch" must not be negative'),
])
def test_malformed_group_commands_are_refused(request_: dict, message: str) -> None:
    server = ControlServer(lambda: {})
    register_commands(server, Groups())
    reply, ok = _ask(server, **request_)
    assert not ok and not reply["ok"] and message in reply["error"]


def test_group_commands_round_trip() -> None:
    server = ControlServer(lambda: {})
    groups = Groups()
    register_commands(server, groups)
    first, ok = _ask(server, cmd="group.join", group="g", pid=os.getpid(), seed=42, job="a")
    assert ok and first["seed"] == 42 and len(first["members"]) == 1
    second, _ = _ask(server, cmd="group.join", group="g", pid=os.getpid())
    assert second["seed"] == 42 and [m["id"] for m in second["members"]] == [1, 2]
    profile, ok = _ask(server, cmd="profile", job="a", pid=os.getpid(), epoch=0, steps=10,
                       wait_s=1.5, step_s=3.0)
    assert ok and profile["profile"] == {"steps": 10, "wait_s": 1.5, "step_s": 3.0,
                                         "partners": []}
    listing, _ = _ask(server, cmd="group.list")
    assert listing["groups"]["g"]["seed"] == 42
    assert listing["profiles"][0]["epochs"]["0"]["steps"] == 10
    assert _ask(server, cmd="group.leave", member=1)[1]
    assert _ask(server, cmd="group.leave", member=2)[1]
    assert _ask(server, cmd="group.list")[0]["groups"] == {}


def test_profiles_say_who_shared_the_group_during_the_epoch() -> None:
    """A first epoch alone gives the stagger model's W, one beside a partner its W|conc."""
    groups = Groups(alive=lambda _pid: True)
    a = groups.join("g", 100, "a", 1)
    groups.start_epoch(a.id, 0)
    assert groups.record_profile("a", 100, 0, 10, 1.0, 2.0).partners == []
    b = groups.join("g", 200, "b", None)  # joins during a's epoch 0
    groups.start_epoch(b.id, 0)
    assert groups.record_profile("a", 100, 0, 10, 1.0, 2.0).partners == ["b"]
    assert groups.record_profile("b", 200, 0, 10, 1.0, 2.0).partners == ["a"]
    assert groups.status()["groups"]["g"]["members"][0]["partners"] == ["b"]
    groups.leave(b.id)
    groups.start_epoch(a.id, 1)
    assert groups.record_profile("a", 100, 1, 10, 1.0, 2.0).partners == []
    assert groups.record_profile("c", 300, 0, 10, 1.0, 2.0).partners == []  # not in a group


def test_members_may_send_the_file_list_at_once() -> None:
    groups = Groups()
    a = groups.join("g", os.getpid(), "a", seed=5)
    b = groups.join("g", os.getpid(), "b", seed=None)
    paths = [f"f{i}".encode() for i in range(5)]
    groups.add_files(a.id, 0, paths[:2], 5)
    groups.add_files(b.id, 0, paths[:3], 5)  # interleaved chunks of the same list
    group = groups.add_files(b.id, 3, paths[3:], 5)
    assert group.has_order and group.files == paths
    assert groups.add_files(a.id, 2, paths[2:], 5).files == paths  # late: already known
    with pytest.raises(Exception, match="has 5 files, not 6"):
        groups.add_files(a.id, 0, paths, 6)
    groups.start_epoch(a.id, 0)
    assert group.order == epoch_order(5, 0, 5)
    assert groups.note_read(a, group.files[group.order[2]]) and group.lead() == 2
    assert not groups.note_read(a, group.files[group.order[1]])  # behind: the lead stays
    assert not groups.note_read(b, b"f0")  # b has not started the epoch


def test_a_user_acts_only_for_its_own_processes_and_memberships() -> None:
    """A caller names only processes of its own uid, acts only on members it created, and
    joins no group another user created; root and the mount's owner may act on any member."""
    server = ControlServer(lambda: {}, owner_uid=1000)
    groups = Groups()
    register_commands(server, groups)
    stranger = 65534
    for request in ({"cmd": "group.join", "group": "g", "pid": 1},
                    {"cmd": "group.join", "group": "g", "pid": os.getpid()},
                    {"cmd": "profile", "job": "j", "pid": 1, "epoch": 0, "steps": 1,
                     "wait_s": 0, "step_s": 0}):
        reply, error = _ask_as(server, stranger, **request)
        assert error == errno.EACCES and "belongs to another user" in reply["error"], reply
    assert not groups.members and not groups.profiles
    member = _ask_as(server, 0, cmd="group.join", group="g", pid=os.getpid())[0]["member"]
    assert groups.members[member].uid == 0
    for request in ({"cmd": "group.leave", "member": member},
                    {"cmd": "group.epoch", "member": member, "epoch": 0},
                    {"cmd": "group.files", "member": member, "offset": 0, "total": 1,
                     "paths": ["a"]}):
        reply, error = _ask_as(server, stranger, **request)
        assert error == errno.EACCES and f"member {member} belongs" in reply["error"], reply
    assert _ask_as(server, stranger, cmd="group.list")[1] == 0  # reading is for everyone
    # another user's member (made directly: no process of that uid here) is the owner's to end
    theirs = groups.join("t", os.getpid(), "t", None, uid=stranger)
    reply, error = _ask_as(server, 0, cmd="group.join", group="t", pid=os.getpid())
    assert error == errno.EACCES and "group 't' belongs to another user" in reply["error"]
    assert _ask_as(server, 1000, cmd="group.leave", member=theirs.id)[1] == 0
    assert _ask_as(server, 0, cmd="group.leave", member=member)[1] == 0
    assert not groups.members
