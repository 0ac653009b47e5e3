"""Unit tests of the small modules: sizes, inode table, stats, control protocol, handler guard."""

from __future__ import annotations

import errno
import json

import pyfuse3
import pytest
import trio

from coordlfs.control_server import ControlHandle, ControlServer
from coordlfs.errors import UserError
from coordlfs.fs import guarded
from coordlfs.inodes import ROOT_INODE, InodeTable
from coordlfs.sizes import parse_size, physical_memory
from coordlfs.stats import Stats, register_commands


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


def test_stats_between_marks() -> None:
    stats = Stats()
    stats.reads.bytes_from_source += 100
    stats.mark("epoch1")
    stats.reads.bytes_from_source += 30
    stats.reads.cache_hits += 2
    stats.mark("epoch2")
    stats.reads.bytes_from_source += 7
    window = stats.between("epoch1", "epoch2")
    assert window["reads"]["bytes_from_source"] == 30
    assert window["reads"]["cache_hits"] == 2
    assert stats.between("epoch2", None)["reads"]["bytes_from_source"] == 7
    assert stats.between(None, None)["reads"]["bytes_from_source"] == 137
    with pytest.raises(KeyError):
        stats.between("nope", None)


def _server() -> ControlServer:
    stats = Stats()
    server = ControlServer(lambda: {"version": "test"})
    register_commands(server, stats)
    return server


def _ask(server: ControlServer, line: bytes) -> tuple[dict, bool]:
    reply, ok = server.handle(line)
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1
    return json.loads(reply), ok


def test_control_commands() -> None:
    server = _server()
    assert _ask(server, b'{"cmd": "status"}')[0]["status"] == {"version": "test"}
    reply, ok = _ask(server, b'{"cmd": "mark", "name": "e1", "id": 7}')
    assert ok and reply["ok"] and reply["id"] == 7 and reply["mark"]["name"] == "e1"
    assert _ask(server, b'{"cmd": "stats", "since": "e1"}')[0]["stats"]["since"] == "e1"
    assert [m["name"] for m in _ask(server, b'{"cmd": "marks"}')[0]["marks"]] == ["e1"]
    assert "mark" in _ask(server, b'{"cmd": "help"}')[0]["commands"]


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
])
def test_control_rejects(line: bytes, message: str) -> None:
    reply, ok = _ask(_server(), line)
    assert not ok and not reply["ok"] and message in reply["error"]


def test_control_handle_status_then_request() -> None:
    server = _server()
    handle = ControlHandle(server)
    status = handle.read(3) + handle.read(1000)
    assert json.loads(status) == {"version": "test"}
    assert handle.read(100) == b""
    handle = ControlHandle(server)
    assert handle.write(b'{"cmd": "mark",')  # a partial line waits for the rest
    assert handle.write(b' "name": "a"}\n')
    assert json.loads(handle.read(1 << 16))["mark"]["name"] == "a"
    assert not handle.write(b"garbage\n")
    assert json.loads(handle.read(1 << 16))["ok"] is False


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
