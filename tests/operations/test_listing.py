"""Directory listings streamed a buffer at a time (``coordlfs.fs.listing``), in-process.

The buffer and the attributed head are made small here, so that a few thousand entries take
many fills and most of them go as names only, as a million would with the real sizes.
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
from pathlib import Path

import pytest
from inprocess import Mount, ctx, mounted

from coordlfs.fs import listing
from coordlfs.fs.inodes import ROOT_INODE
from coordlfs.fs.operations import DirHandle

ENTRIES = 3000
#: a record of ``linux_dirent64`` is at least this long: what bounds a buffer's entries
SMALLEST_RECORD = 24
BUFFER = 2048
ATTRIBUTED = 100
#: replies a "kernel buffer" takes per request
ROOM = 37


def name_of(i: int) -> bytes:
    """Names of many lengths, some not UTF-8, one with a space."""
    return b"f%d-%s%s" % (i, b"x" * (i % 40), b"\xff\xfe" if i % 7 == 0 else b" ")


@pytest.fixture
def big(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(listing, "BUFFER", BUFFER)
    monkeypatch.setattr(listing, "ATTRIBUTED", ATTRIBUTED)
    root = tmp_path / "src"
    directory = os.fsencode(root / "big")
    os.makedirs(directory)
    for i in range(ENTRIES):
        with open(os.path.join(directory, name_of(i)), "wb") as f:
            f.write(b"%d" % i)
    return root


async def big_inode(m: Mount) -> int:
    return (await m.lookup("big")).st_ino


async def list_in_requests(m: Mount, fh: int, start: int = 0,
                           limit: int | None = None) -> list[tuple[bytes, int, int]]:
    """What the kernel gets asking from ``start`` for ``ROOM`` entries a request, as far as
    ``limit`` entries or the end; after each request the handle holds at most one buffer."""
    first = len(m.kernel.listed)
    offset = start
    while limit is None or len(m.kernel.listed) - first < limit:
        before = len(m.kernel.listed)
        m.kernel.room = before + ROOM
        await m.ops.readdir(fh, offset, None)
        handle = m.ops._handles[fh]
        assert isinstance(handle, DirHandle)
        assert len(handle.listing.entries) <= BUFFER // SMALLEST_RECORD + len(listing.DOTS)
        if len(m.kernel.listed) == before:
            break
        offset = m.kernel.listed[-1][2]
    return m.kernel.listed[first:]


def test_a_huge_directory_lists_every_name_once_and_past_the_head_hands_out_no_inode(
        big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted(big, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            inode = await big_inode(m)
            known = len(m.ops.inodes)
            fh = await m.ops.opendir(inode, ctx())
            listed = await list_in_requests(m, fh)
            await m.ops.releasedir(fh)
            names = [name for name, _inode, _next in listed]
            assert names[:2] == [b".", b".."]
            assert sorted(names[2:]) == sorted(os.listdir(os.fsencode(big / "big")))
            given = {name: ino for name, ino, _next in listed[2:] if ino}
            # the head (up to a buffer past ATTRIBUTED) carries inodes, counted once each
            assert ATTRIBUTED <= len(given) <= ATTRIBUTED + BUFFER // SMALLEST_RECORD
            assert len(m.ops.inodes) == known + len(given)
            for name, ino in given.items():
                assert m.ops.inodes[ino].lookups == 1, name
            offsets = [after for _name, _inode, after in listed]
            assert len(set(offsets)) == len(offsets)  # each a place to resume from

        m.run(body)


def test_resuming_at_any_offset_given_continues_after_that_entry(
        big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rewinddir, seekdir back and forward, and a kernel that asks again from inside the last
    reply (its reader took fewer entries than the reply held) all resume exactly."""
    with mounted(big, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            fh = await m.ops.opendir(await big_inode(m), ctx())
            whole = [(name, after) for name, _i, after in await list_in_requests(m, fh)]
            names = [name for name, _after in whole]
            for at in (ENTRIES - 5, 1500, 2, 1, 0, ROOM // 2, 2999, 700):
                start = whole[at - 1][1] if at else 0
                got = await list_in_requests(m, fh, start, limit=3 * ROOM)
                assert [name for name, _i, _next in got] == names[at : at + 3 * ROOM], at
            await m.ops.releasedir(fh)

        m.run(body)


def test_entries_added_and_removed_while_listing_show_at_most_once(
        big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = os.fsencode(big / "big")
    with mounted(big, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            fh = await m.ops.opendir(await big_inode(m), ctx())
            first = await list_in_requests(m, fh, limit=ENTRIES // 2)
            removed = {name_of(i) for i in range(0, ENTRIES, 10)}
            for name in removed:
                os.unlink(os.path.join(directory, name))
            added = {b"new-%d" % i for i in range(500)}
            for name in added:
                open(os.path.join(directory, name), "wb").close()
            rest = await list_in_requests(m, fh, first[-1][2])
            await m.ops.releasedir(fh)
            names = [name for name, _i, _next in first + rest]
            assert len(names) == len(set(names))  # no name twice
            kept = {name_of(i) for i in range(ENTRIES)} - removed
            assert kept <= set(names)  # every entry there throughout, listed
            inodes = [ino for name, ino, _next in first + rest if ino and name not in listing.DOTS]
            assert len(inodes) == len(set(inodes))  # no inode handed out twice

        m.run(body)


def test_two_handles_of_one_directory_list_independently(
        big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted(big, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            inode = await big_inode(m)
            one, two = await m.ops.opendir(inode, ctx()), await m.ops.opendir(inode, ctx())
            head = await list_in_requests(m, one, limit=5 * ROOM)
            whole = await list_in_requests(m, two)
            tail = await list_in_requests(m, one, head[-1][2])
            for fh in (one, two):
                await m.ops.releasedir(fh)
            assert [n for n, _i, _x in head + tail] == [n for n, _i, _x in whole]

        m.run(body)


def test_names_only_replies_clear_the_node_id_and_keep_d_ino() -> None:
    names_only = listing.NAMES_ONLY
    assert names_only.works  # on the pyfuse3 this project pins, the layout is found
    attr = names_only.attr
    attr.st_ino = 123456789
    names_only.node_id.value = 0
    assert attr.st_ino == 0  # the node id the reply carries
    raw = ctypes.string_at(id(attr), type(attr).__basicsize__)
    assert struct.pack("=Q", 123456789) in raw  # the d_ino it carries
    assert listing.NamesOnly._node_id_offset(type(attr)()) is not None


def test_the_root_listing_keeps_the_control_entry_hidden(
        big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted(big, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            fh = await m.ops.opendir(ROOT_INODE, ctx())
            listed = await list_in_requests(m, fh)
            await m.ops.releasedir(fh)
            assert [name for name, _i, _next in listed] == [b".", b"..", b"big"]

        m.run(body)


def test_without_names_only_every_entry_carries_attributes_and_a_lookup(
        big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another pyfuse3's layout, where the node id's place is not found: as before, streamed."""
    monkeypatch.setattr(listing.NAMES_ONLY, "works", False)
    with mounted(big, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            fh = await m.ops.opendir(await big_inode(m), ctx())
            listed = await list_in_requests(m, fh)
            await m.ops.releasedir(fh)
            assert len(listed) == ENTRIES + 2
            for name, ino, _next in listed[2:]:
                assert ino and m.ops.inodes[ino].lookups == 1, name

        m.run(body)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts an overlayfs")
def test_a_source_whose_cookies_start_at_1_resumes_at_every_offset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An overlayfs merged directory numbers its entries 1, 2, 3 ... with its dots among them:
    no cookie of a real entry may pass for the start or a dot."""
    layers = {name: tmp_path / name for name in ("lower", "upper", "work", "src")}
    for path in layers.values():
        path.mkdir()
    for i in range(30):
        (layers["lower" if i % 2 else "upper"] / f"f{i}").write_bytes(b"")
    options = ",".join(f"{n}dir={layers[n]}" for n in ("lower", "upper", "work"))
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(layers["src"])],
                   check=True)
    try:
        with mounted(layers["src"], tmp_path / "cache", monkeypatch) as m:
            async def body() -> None:
                fh = await m.ops.opendir(ROOT_INODE, ctx())
                whole = [(n, after) for n, _i, after in await list_in_requests(m, fh)]
                names = [name for name, _after in whole]
                assert sorted(names) == sorted([b".", b"..", *(b"f%d" % i for i in range(30))])
                for at in range(len(whole)):
                    got = await list_in_requests(m, fh, whole[at - 1][1] if at else 0, limit=1)
                    assert [n for n, _i, _next in got] == names[at:], at
                await m.ops.releasedir(fh)

            m.run(body)
    finally:
        subprocess.run(["umount", "-l", str(layers["src"])], check=False)
