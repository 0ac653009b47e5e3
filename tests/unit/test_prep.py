"""The daemon's books for prep-sharing (coordlfs.jobs.prep), called directly: epochs, claims, the
staging bound, release of used batches, members that die or hang, and malformed requests."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from coordlfs.jobs.prep import HANG_FACTOR, Prep, register_commands
from coordlfs.protocol.server import ControlServer
from coordlfs.protocol.spec import RequestError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def books(tmp_path: Path):
    alive: set[int] = {101, 102, 103}
    clock = Clock()
    prep = Prep(1 << 20, root=str(tmp_path / "staging"), alive=alive.__contains__, clock=clock)
    return prep, alive, clock


def join(prep: Prep, pid: int, samples: int = 10, batch: int = 4, **kw) -> int:
    args = {"drop_last": False, "min_members": 1, "hang_floor_s": 5.0, **kw}
    return prep.join("g", pid, f"job{pid}", samples, batch, args["drop_last"],
                     args["min_members"], args["hang_floor_s"]).id


def produce(prep: Prep, member: int, size: int = 100) -> int | None:
    """Claim, reserve, write and publish one batch, as a job's producer thread does."""
    batch = prep.claim(member)["batch"]
    if batch is None:
        return None
    room = prep.reserve(member, batch, size)
    assert not room["full"]
    Path(room["path"]).write_bytes(b"x" * size)
    prep.publish(member, batch)
    return batch


def consume_all(prep: Prep, member: int) -> list[int]:
    seen, done = [], []
    while True:
        reply = prep.next(member, done)
        if reply.get("end"):
            return seen
        assert "batch" in reply, reply
        seen.append(reply["batch"])
        done = [reply["batch"]]


def test_every_member_uses_every_batch_once_and_files_go(books) -> None:
    prep, _alive, _clock = books
    a, b = join(prep, 101, min_members=2), join(prep, 102)
    assert prep.start_epoch(a) == {"wait": True, "running": False, "asked": 1, "members": 2,
                                   "min_members": 2}
    assert prep.start_epoch(b)["epoch"] == 0
    assert prep.start_epoch(a)["epoch"] == 0
    assert prep.groups["g"].batches == 3  # 10 samples in batches of 4
    made = [produce(prep, a), produce(prep, b), produce(prep, a), produce(prep, b)]
    assert made == [0, 1, 2, None]
    directory = prep.groups["g"].epoch.directory
    assert len(os.listdir(directory)) == 3 and prep.used == 300
    assert sorted(consume_all(prep, a)) == [0, 1, 2]
    assert prep.used == 300  # b has used none yet
    # a asks for its next epoch while b is still in this one: it waits, it is not handed
    # the running epoch again
    assert prep.start_epoch(a)["wait"]
    assert sorted(consume_all(prep, b)) == [0, 1, 2]
    assert prep.used == 0 and prep.groups["g"].epoch is None and not os.path.exists(directory)
    assert prep.counters["published"] == prep.counters["released"] == 3
    # the next epoch starts when both asked
    assert prep.start_epoch(b)["epoch"] == 1 and prep.start_epoch(a)["epoch"] == 1


def test_a_batch_goes_once_the_last_member_acknowledged_it(books) -> None:
    prep, _alive, _clock = books
    a, b = join(prep, 101, min_members=2), join(prep, 102)
    prep.start_epoch(a), prep.start_epoch(b)
    batch = produce(prep, a)
    assert prep.next(a, [])["batch"] == batch
    assert prep.next(b, [])["batch"] == batch
    assert prep.next(a, [batch]) == {"wait": True, "epoch": 0}
    assert batch in prep.groups["g"].epoch.staged  # b still uses it
    prep.next(b, [batch])
    assert batch not in prep.groups["g"].epoch.staged and prep.used == 0


def test_the_staging_bound_holds_and_an_oversized_batch_is_refused(books) -> None:
    prep, _alive, _clock = books
    prep.capacity = 250
    a = join(prep, 101)
    prep.start_epoch(a)
    produce(prep, a, 100)
    produce(prep, a, 100)
    batch = prep.claim(a)["batch"]
    assert prep.reserve(a, batch, 100)["full"] and prep.used == 200
    assert prep.peak <= prep.capacity
    first = prep.next(a, [])["batch"]
    prep.next(a, [first])  # used and acknowledged: room again
    assert not prep.reserve(a, batch, 100)["full"] and prep.used == 200
    assert prep.peak <= prep.capacity
    # a batch larger than the whole area is refused, even when it is empty: waiting would
    # not help, and the area never holds more than its bound (the loader goes on alone)
    other = Prep(10, root=prep.directory + "-x", alive=lambda _p: True, clock=Clock())
    m = other.join("g", 1, "j", 4, 4, False, 1, 5.0).id
    other.start_epoch(m)
    with pytest.raises(RequestError, match="does not fit"):
        other.reserve(m, other.claim(m)["batch"], 10**12)
    assert other.used == 0 and other.status()["staging"]["used_bytes"] == 0
    assert not other.reserve(m, 0, 10)["full"]


def test_a_dead_member_hands_back_its_claims_and_pins_nothing(books) -> None:
    prep, alive, _clock = books
    a, b = join(prep, 101, min_members=2), join(prep, 102)
    prep.start_epoch(a), prep.start_epoch(b)
    produce(prep, a)  # batch 0, staged for both
    claimed = prep.claim(b)["batch"]  # batch 1: b dies before publishing it
    prep.reserve(b, claimed, 100)
    assert prep.claim(a) == {"batch": 2, "epoch": 0}
    assert prep.claim(a) == {"batch": None, "epoch": 0, "outstanding": 1}
    alive.discard(102)
    assert [m.id for m in prep.tick()] == [b]
    assert prep.counters["taken_over"] == 1 and prep.used == 100  # b's reservation is gone
    assert prep.claim(a)["batch"] == 1  # taken over
    assert prep.groups["g"].epoch.staged[0].unseen == {a}  # batch 0 waits for a only


def test_a_member_that_stops_asking_is_expelled_after_its_timeout(books) -> None:
    prep, _alive, clock = books
    a, b = join(prep, 101, min_members=2), join(prep, 102)
    prep.start_epoch(a), prep.start_epoch(b)
    for _ in range(3):
        produce(prep, a)
    done: list[int] = []
    for _ in range(2):  # b is handed batches 1 s apart: its time per batch is 1 s
        done = [prep.next(b, done)["batch"]]
        clock.now += 1.0
    member = prep.members[b]
    assert member.batch_s == pytest.approx(1.0)
    timeout = prep.hang_timeout(member)
    assert timeout == max(5.0, HANG_FACTOR * 1.0)
    clock.now += timeout - 1.5
    prep.next(a, [])
    assert prep.tick() == []
    clock.now += 2.0
    assert [m.id for m in prep.tick()] == [b]
    assert prep.counters["expelled"] == 1
    with pytest.raises(RequestError, match="no prep member"):
        prep.next(b, [])


def test_a_late_joiner_starts_at_the_next_epoch(books) -> None:
    prep, _alive, _clock = books
    a = join(prep, 101)
    assert prep.start_epoch(a)["epoch"] == 0
    late = join(prep, 102)
    assert prep.start_epoch(late)["wait"] and prep.start_epoch(late)["running"]
    with pytest.raises(RequestError, match="no running epoch"):
        prep.claim(late)
    while produce(prep, a) is not None:
        pass
    consume_all(prep, a)
    assert prep.start_epoch(a) == {"epoch": 1, "batches": 3, "members": ["job101", "job102"]}
    assert prep.start_epoch(late)["epoch"] == 1


def test_a_laggard_does_not_hold_the_epoch_back_past_the_floor(books) -> None:
    prep, _alive, clock = books
    a, _b = join(prep, 101), join(prep, 102)
    assert prep.start_epoch(a)["wait"]
    clock.now += 5.1
    assert prep.start_epoch(a)["epoch"] == 0
    assert prep.groups["g"].epoch.members == {a}


def test_leaving_last_removes_the_group_and_its_files(books) -> None:
    prep, _alive, _clock = books
    a = join(prep, 101)
    prep.start_epoch(a)
    produce(prep, a)
    directory = prep.groups["g"].epoch.directory
    prep.leave(a)
    assert prep.groups == {} and prep.used == 0 and not os.path.exists(directory)


def test_jobs_must_agree_on_the_batches(books) -> None:
    prep, _alive, _clock = books
    join(prep, 101)
    with pytest.raises(RequestError, match="same dataset, batch size and drop_last"):
        join(prep, 102, batch=8)
    with pytest.raises(RequestError, match="no process"):
        join(prep, 999)


def test_a_batch_must_be_claimed_reserved_and_written_before_publishing(books) -> None:
    prep, _alive, _clock = books
    a, b = join(prep, 101), join(prep, 102)
    prep.start_epoch(a), prep.start_epoch(b)
    batch = prep.claim(a)["batch"]
    with pytest.raises(RequestError, match="not claimed by member"):
        prep.reserve(b, batch, 10)
    with pytest.raises(RequestError, match="no room reserved"):
        prep.publish(a, batch)
    prep.reserve(a, batch, 10)
    with pytest.raises(RequestError, match="cannot stat"):
        prep.publish(a, batch)


@pytest.mark.parametrize(("request_", "error"), [
    ({"cmd": "prep.join", "group": "g", "pid": 101}, '"samples" must be an integer'),
    ({"cmd": "prep.join", "group": "g", "pid": 101, "samples": 0, "batch_size": 2},
     '"samples" must be a positive integer'),
    ({"cmd": "prep.join", "group": "g", "pid": 101, "samples": 3, "batch_size": 4,
      "drop_last": True}, "at least one full batch"),
    ({"cmd": "prep.join", "group": "", "pid": 101, "samples": 3, "batch_size": 1},
     '"group" must be 1 to'),
    ({"cmd": "prep.join", "group": "g", "pid": 101, "samples": 3, "batch_size": 1,
      "min_members": 0}, '"min_members" must be'),
    ({"cmd": "prep.join", "group": "g", "pid": 101, "samples": 3, "batch_size": 1,
      "hang_timeout_s": "soon"}, '"hang_timeout_s" must be'),
    ({"cmd": "prep.epoch"}, '"member" must be an integer'),
    ({"cmd": "prep.epoch", "member": 77}, "no prep member 77"),
    ({"cmd": "prep.reserve", "member": 1, "batch": -1, "bytes": 5}, '"batch" must not be'),
    ({"cmd": "prep.reserve", "member": 1, "batch": 0, "bytes": 0}, '"bytes" must be positive'),
    ({"cmd": "prep.next", "member": 1, "done": "all"}, '"done" must be a list'),
    ({"cmd": "prep.next", "member": 1, "done": [True]}, '"done" must be a list'),
])
def test_malformed_prep_requests_get_errors(books, request_: dict, error: str) -> None:
    prep, _alive, _clock = books
    server = ControlServer(lambda: {})
    register_commands(server, prep)
    line, code = server.handle(json.dumps(request_).encode())
    reply = json.loads(line)
    assert code == errno.EINVAL and not reply["ok"] and error in reply["error"], reply


def test_stale_staging_directories_of_dead_daemons_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "staging"
    (root / "999999999" / "1").mkdir(parents=True)
    (root / "999999999" / "1" / "0-1.pt").write_bytes(b"x")
    (root / str(os.getpid())).mkdir()
    Prep(10, root=str(root))
    assert sorted(os.listdir(root)) == [str(os.getpid())]


def test_each_user_reserves_at_most_its_share_of_the_staging_area(books) -> None:
    """Users preparing at once split the area evenly: one user's job that reserves much and
    never publishes cannot starve another user's groups."""
    prep, _alive, _clock = books
    prep.capacity = 1000
    mine = prep.join("a", 101, "a", 10, 4, False, 1, 5.0, uid=1000).id
    prep.start_epoch(mine)
    batch = prep.claim(mine)["batch"]
    assert prep.share(1000) == 1000 and prep.share(2000) == 500  # a second user would halve it
    theirs = prep.join("b", 102, "b", 10, 4, False, 1, 5.0, uid=2000).id
    prep.start_epoch(theirs)
    with pytest.raises(RequestError, match="share of the staging area"):
        prep.reserve(mine, batch, 501)
    assert not prep.reserve(mine, batch, 500)["full"]
    other = prep.claim(mine)["batch"]
    # the share counts all its reservations: the next waits until one is published
    assert prep.reserve(mine, other, 1)["full"]
    assert not prep.reserve(theirs, prep.claim(theirs)["batch"], 500)["full"]
    assert prep.used == 1000 <= prep.capacity


def test_a_user_acts_only_on_its_own_prep_members(books) -> None:
    prep, _alive, _clock = books
    server = ControlServer(lambda: {}, owner_uid=1000)
    register_commands(server, prep)
    member = prep.join("g", 101, "a", 10, 4, False, 1, 5.0, uid=0).id

    def ask(uid: int, **request: object) -> tuple[dict, int]:
        line, code = server.handle(json.dumps(request).encode(), server.caller(uid, 1))
        return json.loads(line), code

    for cmd in ("prep.epoch", "prep.claim", "prep.leave", "prep.next"):
        reply, code = ask(65534, cmd=cmd, member=member)
        assert code == errno.EACCES and "belongs to another user" in reply["error"], reply
    reply, code = ask(65534, cmd="prep.reserve", member=member, batch=0, bytes=10**12)
    assert code == errno.EACCES and prep.used == 0
    reply, code = ask(65534, cmd="prep.join", group="x", pid=1, samples=4, batch_size=2,
                      hang_timeout_s=86400)
    assert code == errno.EACCES and "process 1 belongs to another user" in reply["error"]
    with pytest.raises(RequestError, match="belongs to another user"):
        prep.join("g", 102, "b", 10, 4, False, 1, 5.0, uid=65534)  # root's group
    assert ask(65534, cmd="prep.list")[1] == 0
    assert ask(1000, cmd="prep.epoch", member=member)[1] == 0  # the mount's owner may
    assert ask(0, cmd="prep.leave", member=member)[1] == 0 and not prep.members
