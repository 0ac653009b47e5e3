"""A restart over a kept cache: the journal's checkpoint and change lines, entries adopted
unchecked and checked in the background, never served once their file changed."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import trio

from coordlfs.cache import journal
from coordlfs.cache.cache import FILES, WholeFileCache, file_name
from coordlfs.cache.entries import Entry
from coordlfs.cache.journal import JOURNAL
from coordlfs.cache.published import INDEX, IndexReader
from coordlfs.cache.stats import ReadCounters
from coordlfs.source.source import Source

NAMES = [f"d{i % 3}/f{i}" for i in range(12)]


@pytest.fixture
def source(tmp_path: Path) -> Source:
    src = tmp_path / "src"
    for i, name in enumerate(NAMES):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(os.urandom(1000 + 97 * i))
    opened = Source(str(src))
    yield opened
    opened.close()


def _cache(tmp_path: Path) -> WholeFileCache:
    return WholeFileCache(str(tmp_path / "cache"), 1 << 20, 1 << 20, ReadCounters())


def _kept(tmp_path: Path, source: Source, checkpoint: bool = True) -> None:
    """Fill a cache with every file and stop: with a checkpoint (an unmount), or with only
    the change lines a killed daemon leaves."""
    cache = _cache(tmp_path)
    cache.load(source)

    async def fill() -> None:
        for name in NAMES:
            st = source.lstat(name.encode())
            key = (st.st_dev, st.st_ino)
            await cache.fill(key, cache.reserve(key, name.encode(), st), source)

    trio.run(fill)
    journal = tmp_path / "cache" / JOURNAL
    lines = journal.read_bytes()
    cache.close(keep=True)
    if not checkpoint:  # as after SIGKILL: the lines written so far, no checkpoint of them
        journal.write_bytes(lines)


def _served(cache: WholeFileCache, source: Source, name: str) -> bytes | None:
    """What an open of ``name`` would be served from the cache (its fresh lstat compared)."""
    st = source.lstat(name.encode())
    entry = cache.lookup((st.st_dev, st.st_ino), st)
    return None if entry is None else bytes(cache.data(entry, 0, entry.size))


def _change_three(src: Path) -> dict[str, bytes]:
    """Rewrite one file in place (same size), remove one, grow one."""
    (src / NAMES[0]).write_bytes(os.urandom((src / NAMES[0]).stat().st_size))
    (src / NAMES[1]).unlink()
    with open(src / NAMES[2], "ab") as f:
        f.write(b"more")
    return {name: (src / name).read_bytes() for name in NAMES if (src / name).exists()}


@pytest.mark.parametrize("checkpoint", [True, False], ids=["unmounted", "killed"])
def test_adopted_unchecked_never_serves_a_changed_file(tmp_path: Path, source: Source,
                                                       checkpoint: bool) -> None:
    _kept(tmp_path, source, checkpoint)
    now = _change_three(Path(source.path))
    cache = _cache(tmp_path)
    assert cache.adopt() == len(NAMES)  # unchecked: the removed file's entry too
    for name in NAMES:
        served = _served(cache, source, name) if name in now else None
        assert served in (None, now.get(name))  # never the old bytes
        if name not in NAMES[:3]:
            assert served == now[name]
    assert NAMES[1] not in now
    cache.close(keep=False)


def test_background_check_drops_changed_files_and_publishes_the_rest(tmp_path: Path,
                                                                     source: Source) -> None:
    _kept(tmp_path, source)
    now = _change_three(Path(source.path))
    cache = _cache(tmp_path)
    cache.share(source)
    cache.publisher.want()  # a client reads the index
    cache.adopt()
    used = cache.room.used
    trio.run(cache.check, source)
    assert len(cache.entries) == len(NAMES) - 3
    assert cache.room.used < used
    reader = IndexReader(str(tmp_path / "cache" / INDEX), str(tmp_path / "cache" / "files"))
    for name in NAMES[3:]:
        found = reader.find(name.encode())
        assert found is not None and bytes(reader.view(found) or b"") == now[name]
    for name in NAMES[:3]:
        assert reader.find(name.encode()) is None
    reader.close()
    cache.close(keep=True)
    again = _cache(tmp_path)  # the drops were journaled: not adopted again
    assert again.adopt() == len(NAMES) - 3
    again.close(keep=False)


def test_check_with_a_change_meanwhile_publishes_only_after_its_own_check(
        tmp_path: Path, source: Source) -> None:
    _kept(tmp_path, source)
    cache = _cache(tmp_path)
    cache.share(source)
    cache.publisher.want()  # a client reads the index
    cache.adopt()
    checking = cache.restart.checking(cache.restart.unchecked())
    stats = [source.lstat(checked.path) for checked in checking]
    changes = cache.publisher.changes
    (Path(source.path) / NAMES[4]).write_bytes(b"changed after the stat")
    cache.publisher.changed(NAMES[4].encode(), False)  # what the watch reports
    cache.restart.checked(checking, stats, changes)
    assert len(cache.index) == len(NAMES) - 1  # each published after a fresh lstat
    assert _served(cache, source, NAMES[4]) is None
    cache.close(keep=False)


def test_the_checkpoint_reads_back_without_parsing_lines(tmp_path: Path,
                                                          source: Source) -> None:
    _kept(tmp_path, source)
    journal = (tmp_path / "cache" / JOURNAL).read_bytes()
    header = json.loads(journal.split(b"\n", 1)[0])
    assert header["checkpoint"] == 1 and header["entries"] == len(NAMES)
    cache = _cache(tmp_path)
    assert cache.load(source) == len(NAMES)
    for name in NAMES:
        assert _served(cache, source, name) == (Path(source.path) / name).read_bytes()
    assert (tmp_path / "cache" / JOURNAL).read_bytes() == journal  # nothing to rewrite
    cache.close(keep=False)


def test_a_journal_of_lines_only_is_adopted(tmp_path: Path, source: Source) -> None:
    """A daemon killed before any checkpoint, or the journal of an older coordlfs."""
    _kept(tmp_path, source, checkpoint=False)
    lines = (tmp_path / "cache" / JOURNAL).read_bytes().split(b"\n", 1)[1]
    (tmp_path / "cache" / JOURNAL).write_bytes(lines)
    cache = _cache(tmp_path)
    assert cache.load(source) == len(NAMES)
    cache.close(keep=False)


@pytest.mark.parametrize("damage", ["torn", "flipped", "header"])
def test_a_damaged_checkpoint_starts_cold_with_a_warning(tmp_path: Path, source: Source,
                                                         caplog, damage: str) -> None:
    _kept(tmp_path, source)
    path = tmp_path / "cache" / JOURNAL
    data = bytearray(path.read_bytes())
    if damage == "torn":
        del data[len(data) // 2 :]
    elif damage == "flipped":
        data[-20] ^= 0x40
    else:
        data[: data.index(b"\n")] = b'{"checkpoint": 1, "entries": -5}'
    path.write_bytes(bytes(data))
    cache = _cache(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert cache.load(source) == 0
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "damaged" in caplog.records[0].getMessage()
    assert not os.listdir(tmp_path / "cache" / "files")  # all removed
    for name in NAMES:
        assert _served(cache, source, name) is None
    cache.close(keep=False)


def test_adopting_many_entries_is_quick(tmp_path: Path) -> None:
    """A checkpoint of 100,000 entries adopts in well under a second per 100,000 (the
    target is a mount serving within 10 s over a million)."""
    from array import array

    from coordlfs.cache.entries import Columns
    from coordlfs.cache.journal import Journal

    n = 100_000
    (tmp_path / "cache").mkdir()
    fd = os.open(tmp_path / "cache", os.O_RDONLY)
    paths = [b"d%03d/f%07d.bin" % (i % 1000, i) for i in range(n)]
    Journal(fd, str(tmp_path / "cache")).checkpoint(Columns(
        array("Q", [1]) * n, array("Q", range(n)), array("q", [100]) * n,
        array("q", [5]) * n, array("q", [6]) * n, array("q", range(0, 100 * n, 100)),
        array("I", map(len, paths)), b"".join(paths)))
    os.close(fd)
    (tmp_path / "cache" / FILES).mkdir(mode=0o700)
    for number in range(0, 100 * n, 100):
        (tmp_path / "cache" / FILES / file_name(number)).touch()
    cache = WholeFileCache(str(tmp_path / "cache"), 4096 * n, 100, ReadCounters())
    started = time.process_time()
    assert cache.adopt() == n
    assert time.process_time() - started < 5  # about 0.5 s here; generous for a busy machine
    assert cache.entries.get((1, 777)).path == b"d777/f0000777.bin"
    cache.close(keep=False)


def test_change_lines_replace_drop_and_skip_what_does_not_fit(tmp_path: Path,
                                                              source: Source) -> None:
    """Lines after the checkpoint: an entry added again under a new number replaces the
    checkpoint's, a drop of a number no entry has changes nothing, numbers out of range are
    skipped like any hostile line."""
    _kept(tmp_path, source)
    st = source.lstat(NAMES[5].encode())
    key = f"{st.st_dev:x}-{st.st_ino:x}"
    kept = _cache(tmp_path)
    kept.adopt()
    files = tmp_path / "cache" / FILES
    os.rename(files / file_name(kept.entries.get((st.st_dev, st.st_ino)).offset),
              files / file_name(1 << 19))
    kept.close(keep=True)
    lines = [
        {"key": key, "path": NAMES[5], "size": st.st_size, "mtime_ns": st.st_mtime_ns,
         "ctime_ns": st.st_ctime_ns, "offset": 1 << 19},  # refilled under another number
        {"key": key, "offset": 12345, "dropped": True},  # not its number: nothing
        {"key": f"{1 << 70:x}-1", "path": "x", "size": 1, "mtime_ns": 1, "ctime_ns": 1,
         "offset": 0},  # a device no column holds
    ]
    with open(tmp_path / "cache" / JOURNAL, "a") as journal:
        journal.writelines(json.dumps(line) + "\n" for line in lines)
    cache = _cache(tmp_path)
    assert cache.adopt() == len(NAMES)
    assert cache.entries.get((st.st_dev, st.st_ino)).offset == 1 << 19
    assert _served(cache, source, NAMES[6]) == (Path(source.path) / NAMES[6]).read_bytes()
    cache.close(keep=False)


def test_journal_lines_give_back_their_entries_whatever_bytes_a_path_holds() -> None:
    """``journal.added`` writes a line by a template (cheaper per fill than ``json.dumps``):
    it parses back, through the replay a restart runs, to the entry it was written for, for
    paths with bytes that are not UTF-8, quotes, backslashes and a newline; a ``dropped``
    line takes it away again."""
    paths = [b"plain/f.bin", b'q"uote\\back', b"new\nline", b"\xff\xfe not utf-8",
             b"\xc3\xa9t\xc3\xa9"]
    replay = journal.Replay()
    for number, path in enumerate(paths):
        entry = Entry(path, 100 + number, 1_764_000_000_123_456_789, 1_764_000_000_987_654_321,
                      number)
        replay.line(journal.added((0x803, 0x1E240 + number), entry).encode())
    replay.line(journal.dropped((0x803, 0x1E240), Entry(paths[0], 100, 0, 0, 0)).encode())
    columns = replay.columns()
    assert list(columns.ino) == [0x1E240 + n for n in range(1, len(paths))]
    assert list(columns.size) == [100 + n for n in range(1, len(paths))]
    assert list(columns.mtime_ns) == [1_764_000_000_123_456_789] * (len(paths) - 1)
    assert list(columns.ctime_ns) == [1_764_000_000_987_654_321] * (len(paths) - 1)
    assert columns.paths == b"".join(paths[1:])
    assert list(columns.path_len) == [len(p) for p in paths[1:]]
