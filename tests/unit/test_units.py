"""Unit tests of the small modules: sizes, inode table, stats, control protocol, handler guard."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pyfuse3
import pytest
import trio

from coordlfs.cache.stats import Stats, register_commands
from coordlfs.errors import UserError
from coordlfs.fs.inodes import ROOT_INODE, InodeTable
from coordlfs.fs.operations import guarded
from coordlfs.jobs.prep import Prep
from coordlfs.jobs.prep import register_commands as register_prep_commands
from coordlfs.protocol import spec as control_spec
from coordlfs.protocol.server import (
    MAX_DEPTH,
    MAX_HELD,
    MAX_HELD_UNPRIVILEGED,
    MAX_REPLIES,
    MAX_REQUEST,
    MAX_WAITING,
    MAX_WAITING_PER_USER,
    ControlHandle,
    ControlServer,
)
from coordlfs.protocol.spec import Access, Command
from coordlfs.sizes import parse_size, physical_memory, plural
from coordlfs.source.source import Version


@pytest.mark.parametrize(("text", "value"), [
    ("0", 0), ("4096", 4096), ("1K", 1024), ("40G", 40 << 30), ("1.5M", 3 << 19),
    ("2t", 2 << 40), ("512MiB", 512 << 20), ("8 GB", 8 << 30),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_percent_of_memory() -> None:
    assert parse_size("50%") == physical_memory() // 2
    assert parse_size("100%") == physical_memory()


@pytest.mark.parametrize("text", ["", "-1", "-5G", "ten", "5X", "101%", "1e3", "G"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(UserError, match="bad --cache-size"):
        parse_size(text, "--cache-size")


@pytest.mark.parametrize(("n", "noun", "said"), [
    (1, "file", "1 file"), (0, "file", "0 files"), (2, "file", "2 files"),
    (1, "miss", "1 miss"), (3, "miss", "3 misses"), (2, "batch", "2 batches"),
    (2, "entry", "2 entries"), (2, "day", "2 days"), (1, "profiled epoch", "1 profiled epoch"),
    (3, "epoch", "3 epochs"), (2, "profiled epoch", "2 profiled epochs"),
])
def test_plural(n: int, noun: str, said: str) -> None:
    assert plural(n, noun) == said


def test_inode_table_counts_and_forgets() -> None:
    table = InodeTable((1, 100))
    a = table.inode_for((1, 5), b"a")
    assert table.inode_for((1, 5), b"hardlink-to-a") == a  # same (dev, ino): same inode
    assert table[a].path == b"hardlink-to-a"
    table.ref(a)
    table.ref(a)
    table.forget(a, 1)
    assert table[a].lookups == 1
    table.forget(a, 1)
    with pytest.raises(KeyError):
        table[a]
    b = table.inode_for((1, 5), b"a")
    assert b != a  # numbers are never reused
    table.drop_if_unreferenced(b)
    assert len(table) == 1
    table.forget(ROOT_INODE, 10)  # the root is never forgotten
    assert table[ROOT_INODE].path == b""


def test_inode_table_detach_gives_the_key_a_new_inode() -> None:
    """A file changed under passthrough opens: the old inode lives on by number until
    forgotten, the key's next inode is another, and forgetting either leaves the other."""
    table = InodeTable((1, 100))
    others = [table.inode_for((1, ino), b"o%d" % ino) for ino in range(6, 200)]  # shared slots
    old = table.inode_for((1, 5), b"f")
    table.ref(old)
    assert table.detached(old) is None
    table.detach(old, Version(5, 10, 20, 30))
    assert table.detached(old) == Version(5, 10, 20, 30)
    assert table.find((1, 5)) is None
    new = table.inode_for((1, 5), b"f")
    table.ref(new)
    assert new != old and table.find((1, 5)) == new and table.detached(new) is None
    assert table[old].key == (1, 5) and table[old].path == b"f" and table[old].lookups == 1
    assert table.forget(old, 1)
    with pytest.raises(KeyError):
        table[old]
    assert table.find((1, 5)) == new and table[new].lookups == 1
    assert all(table.find((1, ino)) == inode for ino, inode in enumerate(others, 6))
    assert table.forget(new, 1) and table.find((1, 5)) is None


def test_stats_between_marks() -> None:
    stats = Stats()
    stats.reads.bytes_from_source += 100
    stats.mark("epoch1")
    stats.reads.bytes_from_source += 30
    stats.reads.read_hits += 2
    stats.mark("epoch2")
    stats.reads.bytes_from_source += 7
    window = stats.between("epoch1", "epoch2")
    assert window["reads"]["bytes_from_source"] == 30
    assert window["reads"]["read_hits"] == 2
    assert stats.between("epoch2", None)["reads"]["bytes_from_source"] == 7
    assert stats.between(None, None)["reads"]["bytes_from_source"] == 137
    with pytest.raises(KeyError):
        stats.between("nope", None)
    with pytest.raises(ValueError, match="mark 'epoch1' comes before 'epoch2'"):
        stats.between("epoch2", "epoch1")
    assert stats.between(None, "epoch1")["reads"]["bytes_from_source"] == 100


OWNER = 1000  # the mount's owner in these tests; root is privileged too
STRANGER = 1001


def _server() -> ControlServer:
    stats = Stats()
    server = ControlServer(lambda: {"version": "test"}, owner_uid=OWNER)
    register_commands(server, stats)
    return server


def _ask(server: ControlServer, line: bytes, uid: int = OWNER) -> tuple[dict, bool]:
    reply, error = server.handle(line, server.caller(uid, 1))
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1
    return json.loads(reply), error == 0


def _read(handle: ControlHandle, size: int) -> bytes:
    return trio.run(handle.read, size)


def _replies(handle: ControlHandle) -> list[dict]:
    return [json.loads(line) for line in _read(handle, 1 << 24).splitlines()]


def test_control_commands() -> None:
    server = _server()
    assert _ask(server, b'{"cmd": "status"}')[0]["status"]["version"] == "test"
    reply, ok = _ask(server, b'{"cmd": "mark", "name": "e1", "id": 7}')
    assert ok and reply["ok"] and reply["id"] == 7 and reply["mark"]["name"] == "e1"
    assert _ask(server, b'{"cmd": "stats", "since": "e1"}')[0]["stats"]["since"] == "e1"
    assert [m["name"] for m in _ask(server, b'{"cmd": "marks"}')[0]["marks"]] == ["e1"]
    helped = _ask(server, b'{"cmd": "help"}')[0]
    assert "mark" in helped["commands"] and helped["access"]["mark"] == Access.MOUNT.value


@pytest.mark.parametrize(("line", "message"), [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"name": "x"}', '"cmd"'),
    (b'{"cmd": 5}', '"cmd"'),
    (b'{"cmd": "explode"}', "unknown command"),
    (b'{"cmd": "mark"}', '"name" must be a string'),
    (b'{"cmd": "mark", "name": true}', '"name" must be a string'),
    (b'{"cmd": "stats", "since": "never"}', "no mark named"),
    (b"\xff\xfe", "not JSON"),
    (b"[" * 100000 + b"]" * 100000, f"nests deeper than {MAX_DEPTH}"),
    (b'{"cmd": "status", "id": ' + b"[" * 40 + b"]" * 40 + b"}", f"deeper than {MAX_DEPTH}"),
])
def test_control_rejects(line: bytes, message: str, caplog: pytest.LogCaptureFixture) -> None:
    reply, ok = _ask(_server(), line)
    assert not ok and not reply["ok"] and message in reply["error"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_nesting_up_to_the_limit_is_accepted() -> None:
    depth = MAX_DEPTH - 1  # inside the request object
    line = b'{"cmd": "status", "id": ' + b"[" * depth + b"]" * depth + b"}"
    reply, ok = _ask(_server(), line)
    assert ok and reply["ok"]


def test_mount_wide_commands_need_root_or_the_owner() -> None:
    server = _server()
    reply, error = server.handle(b'{"cmd": "mark", "name": "x"}', server.caller(STRANGER, 1))
    assert error == errno.EACCES and "mount-wide" in json.loads(reply)["error"]
    for uid in (0, OWNER):
        assert _ask(server, b'{"cmd": "mark", "name": "x"}', uid)[1]
    for line in (b'{"cmd": "status"}', b'{"cmd": "stats"}', b'{"cmd": "marks"}',
                 b'{"cmd": "help"}'):
        assert _ask(server, line, STRANGER)[1], line  # reading is for everyone
    assert json.loads(_read(ControlHandle(server, STRANGER, 1), 1 << 16))["version"] == "test"


def test_a_new_command_is_mount_wide_unless_said_otherwise() -> None:
    server = _server()
    server.add(Command("knob", "a setting"), lambda _a, _c: {})
    assert server.handle(b'{"cmd": "knob"}', server.caller(STRANGER, 1))[1] == errno.EACCES


def test_control_handle_status_then_request() -> None:
    server = _server()
    handle = ControlHandle(server, OWNER, 1)
    status = _read(handle, 3) + _read(handle, 1000)
    assert json.loads(status)["version"] == "test"
    assert _read(handle, 100) == b""
    handle = ControlHandle(server, OWNER, 1)
    assert handle.write(b'{"cmd": "mark",') == 0  # a partial line waits for the rest
    assert _read(handle, 100) == b""  # written to: no status, no reply yet
    assert handle.write(b' "name": "a"}\n') == 0
    assert json.loads(_read(handle, 1 << 16))["mark"]["name"] == "a"
    assert handle.write(b"garbage\n") == errno.EINVAL
    assert json.loads(_read(handle, 1 << 16))["ok"] is False


def test_requests_in_one_write_are_answered_in_order() -> None:
    server = _server()
    handle = ControlHandle(server, OWNER, 1)
    assert handle.write(b'{"cmd": "mark", "name": "a", "id": 1}\n\n'
                        b'{"cmd": "marks", "id": 2}\n') == 0
    first, second = _replies(handle)
    assert (first["id"], first["mark"]["name"]) == (1, "a")
    assert (second["id"], [m["name"] for m in second["marks"]]) == (2, ["a"])
    # a refused request fails the write, and the others in it still run
    assert handle.write(b'nope\n{"cmd": "mark", "name": "b"}\n') == errno.EINVAL
    refused, marked = _replies(handle)
    assert not refused["ok"] and marked["mark"]["name"] == "b"
    stranger = ControlHandle(server, STRANGER, 1)
    assert stranger.write(b'{"cmd": "mark", "name": "s"}\nnope\n') == errno.EACCES  # first
    assert [r["ok"] for r in _replies(stranger)] == [False, False]


def _padded(size: int) -> bytes:
    """A status request exactly ``size`` bytes long (newline excluded)."""
    head = b'{"cmd": "status", "pad": "'
    return head + b"z" * (size - len(head) - 2) + b'"}'


def test_a_line_up_to_the_limit_runs_and_a_longer_one_is_refused_whole() -> None:
    server = _server()
    handle = ControlHandle(server, OWNER, 1)
    assert handle.write(_padded(MAX_REQUEST) + b"\n") == 0
    assert _replies(handle)[0]["ok"]
    assert handle.write(_padded(MAX_REQUEST + 1) + b"\n") == errno.EINVAL
    assert "longer than" in _replies(handle)[0]["error"]
    # the write stopped at the limit: the descriptor drops bytes up to a newline it sees later
    assert handle.write(b'{"cmd": "mark", "name": "lost"}\n') == errno.EINVAL
    assert _read(handle, 100) == b""
    # over the limit in pieces: its tail, a request in appearance, must not run
    head = b'{"cmd": "help", "pad": "' + b"z" * MAX_REQUEST
    assert handle.write(head[: 1 << 19]) == 0
    assert handle.write(head[1 << 19:]) == errno.EINVAL
    assert handle.write(b'"}{"cmd": "mark", "name": "evil"}') == errno.EINVAL
    assert handle.write(b'\n{"cmd": "marks"}\n') == errno.EINVAL
    refused, marks = _replies(handle)
    assert "longer than" in refused["error"] and marks["marks"] == []
    assert handle.write(b'{"cmd": "mark", "name": "fine"}\n') == 0  # the next line runs
    assert _replies(handle)[0]["mark"]["name"] == "fine"
    handle.close()
    assert server.held == 0


def test_a_writer_sending_the_rest_again_never_runs_the_tail() -> None:
    """The kernel splits a large write and reports the pieces before a failed one as written:
    a buffered writer then sends the failed piece again. Nothing of the refused line runs, and
    the request after it runs once."""
    server = _server()
    handle = ControlHandle(server, OWNER, 1)
    line = b'{"cmd": "help", "pad": "' + b"z" * MAX_REQUEST + b'"}'
    data = line + b'\n{"cmd": "mark", "name": "after"}\n'
    piece = 1 << 17  # FUSE's usual largest write
    sent = 0
    while sent < len(data):
        error = handle.write(data[sent:sent + piece])
        if error == 0:
            sent += piece
        elif sent < len(line) - piece:
            raise AssertionError(f"refused at {sent}, before the limit")
        else:
            assert error == errno.EINVAL
            break
    retried = data[sent:]  # the failed piece, sent again (its first write failed: no more)
    assert handle.write(retried) == errno.EINVAL
    replies = _replies(handle)
    assert "longer than" in replies[0]["error"]
    assert [r.get("mark", {}).get("name") for r in replies[1:]] == ["after"]
    assert [m["name"] for m in _ask(server, b'{"cmd": "marks"}')[0]["marks"]] == ["after"]


def test_bytes_held_by_all_handles_are_bounded_and_freed_on_close() -> None:
    server = _server()
    chunk = b"x" * (MAX_REQUEST - 1)  # a line that never ends
    handles = [ControlHandle(server, OWNER, 1) for _ in range(MAX_HELD // MAX_REQUEST + 4)]
    errors = [h.write(chunk) for h in handles]
    assert errors.count(0) == MAX_HELD // len(chunk)
    assert set(errors[errors.index(errno.ENOBUFS):]) == {errno.ENOBUFS}
    held = server.held
    assert held <= MAX_HELD
    full = handles[errors.index(errno.ENOBUFS)]
    assert full.write(b"y" * 100) == errno.ENOBUFS and server.held == held  # nothing kept
    assert full.write(b'{"cmd": "marks"}\n') == 0  # a complete line holds only its reply
    assert _replies(full)[0]["ok"] and server.held == held
    # other users may fill only half, so the owner keeps room for its own requests
    stranger = ControlHandle(server, STRANGER, 1)
    assert stranger.write(b"x") == errno.ENOBUFS
    with pytest.raises(OSError) as info:
        _read(stranger, 100)  # the status would not fit either
    assert info.value.errno == errno.ENOBUFS
    for handle in handles:
        handle.close()
    assert server.held == 0
    assert stranger.write(b"x") == 0 and server.held == 1
    helpers = [ControlHandle(server, STRANGER, 1) for _ in range(MAX_HELD_UNPRIVILEGED //
                                                                     len(chunk) + 1)]
    assert [h.write(chunk) for h in helpers].count(errno.ENOBUFS) == 1


def test_unread_replies_are_bounded() -> None:
    server = _server()
    handle = ControlHandle(server, OWNER, 1)
    request = b'{"cmd": "help"}\n'
    reply_size = len(server.handle(request[:-1])[0])
    count = MAX_REPLIES // reply_size + 10
    assert handle.write(request * count) == errno.ENOBUFS
    replies = _replies(handle)
    assert MAX_REPLIES // reply_size <= len(replies) < count
    assert handle.write(request) == 0  # read: room again


def test_guard_turns_exceptions_into_errnos() -> None:
    @guarded
    async def broken() -> None:
        raise RuntimeError("bug")

    @guarded
    async def missing() -> None:
        raise FileNotFoundError(errno.ENOENT, "gone")

    for handler, code in ((broken, errno.EIO), (missing, errno.ENOENT)):
        with pytest.raises(pyfuse3.FUSEError) as info:
            trio.run(handler)
        assert info.value.errno == code


@pytest.mark.parametrize("command", ["mount", "stats", "umount", "mark", "stagger"])
def test_the_product_loads_no_benchmark(command: str) -> None:
    """Only `coordlfs bench` imports coordlfs.bench, and only benchmarks and tests import
    coordlfs.testbed: the daemon and the everyday commands carry none of either."""
    probe = ("import sys\nimport coordlfs.daemon.daemon\nfrom coordlfs.cli import main\n"
             f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules\n"
             "             if m.startswith(('coordlfs.bench', 'coordlfs.testbed'))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _waiting_server() -> tuple[ControlServer, dict]:
    """A server with ``probe``, which may wait until ``set`` gave it a value."""
    server, state = _server(), {"value": None}
    server.add(Command("probe", "the value, once set", Access.OWN, (control_spec.WAIT,),
                       ready=lambda reply: reply["value"] is not None),
               lambda _a, _c: {"value": state["value"]})

    def put(args: dict, _caller: object) -> dict:
        state["value"] = args["value"]
        return {}

    server.add(Command("set", "set the value", Access.OWN,
                       (control_spec.Arg("value", control_spec.COUNT),)), put)
    return server, state


async def _read_waiting(handle: ControlHandle, meanwhile: Callable[[], Awaitable[None]]) -> bytes:
    """What a read of ``handle`` returns, once ``meanwhile`` ran while it blocked."""
    got: list[bytes] = []

    async def read() -> None:
        got.append(await handle.read(1 << 16))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.sleep(0.05)
        assert not got  # still waiting
        await meanwhile()
    return got[0]


def test_a_waiting_request_is_answered_when_the_state_changes() -> None:
    """The reader blocks in read() until another request changes what it waits for; the
    mount answers other descriptors meanwhile."""
    server, _state = _waiting_server()

    async def set_value() -> None:
        setter = ControlHandle(server, OWNER, 1)
        assert setter.write(b'{"cmd": "set", "value": 7}\n') == 0
        assert json.loads(await setter.read(1 << 16))["ok"]

    async def main() -> None:
        waiter = ControlHandle(server, OWNER, 1)
        assert waiter.write(b'{"cmd": "probe", "timeout_s": 5, "id": 1}\n{"cmd": "status"}\n') == 0
        assert server.waiting[OWNER] == 1 and server.snapshot()["control"]["waiting"] == 1
        first, second = map(json.loads, (await _read_waiting(waiter, set_value)).splitlines())
        assert first == {"ok": True, "value": 7, "id": 1}  # replies keep the requests' order
        assert "status" in second and server.waiting.total() == 0

    trio.run(main)


def test_a_waiting_request_gets_the_answer_so_far_at_its_deadline_or_on_close() -> None:
    """Past ``timeout_s``, or when the mount is going (SIGTERM), the answer is the one so
    far; once the server is closed no request waits."""
    server, _state = _waiting_server()

    async def close() -> None:
        server.close()

    async def main() -> None:
        handle = ControlHandle(server, OWNER, 1)
        handle.write(b'{"cmd": "probe", "timeout_s": 0.1}\n')
        start = trio.current_time()
        assert json.loads(await handle.read(1 << 16)) == {"ok": True, "value": None}
        assert 0.1 <= trio.current_time() - start < 1
        handle.write(b'{"cmd": "probe", "timeout_s": 5}\n')
        assert json.loads(await _read_waiting(handle, close)) == {"ok": True, "value": None}
        handle.write(b'{"cmd": "probe", "timeout_s": 5}\n')
        assert server.waiting.total() == 0

    trio.run(main)


def test_waiting_requests_are_bounded_per_user_and_freed_on_close() -> None:
    server, _state = _waiting_server()
    handles = [ControlHandle(server, STRANGER, 1) for _ in range(MAX_WAITING_PER_USER + 1)]
    for handle in handles:
        assert handle.write(b'{"cmd": "probe", "timeout_s": 5}\n') == 0
    assert server.waiting[STRANGER] == MAX_WAITING_PER_USER
    # past the bound the answer comes at once, not final
    assert json.loads(_read(handles[-1], 1 << 16)) == {"ok": True, "value": None}
    owner = ControlHandle(server, OWNER, 1)  # another user still may wait
    assert owner.write(b'{"cmd": "probe", "timeout_s": 5}\n') == 0 and server.waiting[OWNER] == 1
    held = server.held
    for handle in [*handles, owner]:
        handle.close()
    assert server.waiting.total() == 0 and server.held == 0 < held
    assert MAX_WAITING_PER_USER < MAX_WAITING


def test_a_waiting_prep_request_ends_when_its_member_leaves(tmp_path: Path) -> None:
    prep = Prep(1 << 20, root=str(tmp_path), alive=lambda _pid: True)
    server = ControlServer(lambda: {})
    register_prep_commands(server, prep)
    member = prep.join("g", 101, "a", 4, 2, False, 2, 30.0).id  # waits for a second member

    async def leave() -> None:
        assert prep.members[member].waiting_until > 0  # waiting for the mount: not hung
        prep.leave(member)
        prep.tick()  # the daemon's reaper ticks every second

    async def main() -> None:
        handle = ControlHandle(server, os.getuid(), 1)
        handle.write(json.dumps({"cmd": "prep.epoch", "member": member,
                                 "timeout_s": 5}).encode() + b"\n")
        assert "no prep member" in json.loads(await _read_waiting(handle, leave))["error"]

    trio.run(main)

