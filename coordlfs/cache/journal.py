"""The cache's journal (``index.jsonl``): which source file each entry file holds, so that a
restarted daemon finds the cache warm.

The file is a checkpoint followed by JSON lines. The checkpoint is a JSON header line
(``{"checkpoint": 1, "entries": N, ...}``) and then the entries' columns in binary (device,
inode, size, mtime, ctime, entry number, path length; then the paths end to end), checked by
a CRC-32 in the header: a restart reads the columns straight into arrays, with no parsing
per entry (a million entries in well under a second, where a line each took 15 s with the
checks). Each change since, an entry completed or dropped, is a JSON line appended as it
happens; a torn last line (a crash) is skipped. A checkpoint is only ever written whole
beside the journal and renamed over it, so a torn or corrupt one means the file was damaged:
it is not trusted at all, and the cache starts cold with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import zlib
from array import array
from collections.abc import Callable, Iterator
from typing import BinaryIO

from coordlfs.cache.compact import Key
from coordlfs.cache.entries import Columns, Entry

log = logging.getLogger(__name__)

JOURNAL = "index.jsonl"
_PART = JOURNAL + ".part"
_FORMAT = 1
_decode = json.JSONDecoder().decode
#: a string as JSON
_string = json.JSONEncoder().encode
#: the checkpoint's columns in the order written, and their array codes
_CODES = (("dev", "Q"), ("ino", "Q"), ("size", "q"), ("mtime_ns", "q"), ("ctime_ns", "q"),
          ("offset", "q"), ("path_len", "I"))


def key_name(key: Key) -> str:
    return f"{key[0]:x}-{key[1]:x}"


def _key_of(name: str) -> Key:
    dev, ino = name.split("-")
    return int(dev, 16), int(ino, 16)


def added(key: Key, entry: Entry) -> str:
    """The line of an entry added: a JSON object, written as a template (the path the only
    part ``json`` writes), four times cheaper than ``json.dumps`` of a dict, per fill."""
    return (f'{{"key": "{key_name(key)}", "path": {_string(os.fsdecode(entry.path))}, '
            f'"size": {entry.size}, "mtime_ns": {entry.mtime_ns}, '
            f'"ctime_ns": {entry.ctime_ns}, "offset": {entry.offset}}}' + "\n")


def dropped(key: Key, entry: Entry) -> str:
    """The line of an entry dropped."""
    return f'{{"key": "{key_name(key)}", "offset": {entry.offset}, "dropped": true}}' + "\n"


class Replay:
    """The change lines after a checkpoint, reduced to what each key ends with: the entry of
    its last line, or gone. The entries become columns at the end, so that the lines a
    killed daemon left (a million, after a crash) adopt in bulk, with no table insert and no
    object per line beyond a tuple."""

    def __init__(self) -> None:
        #: key -> position of its last entry added, or -1 if that was dropped again
        self._at: dict[Key, int] = {}
        #: key -> arena offset of a drop of the checkpoint's entry (no line added it)
        self.drops: dict[Key, int] = {}
        #: (dev, ino, size, mtime_ns, ctime_ns, offset, path) added; None once replaced
        self._added: list[tuple | None] = []
        #: lines read, good or not (a torn one is rewritten away)
        self.lines = 0

    def replaced(self) -> Iterator[Key]:
        """Keys whose checkpoint entry (if any) a line replaced or dropped."""
        return iter(self._at)

    def line(self, line: bytes) -> None:
        """Apply one change line; one that is neither an addition nor a drop (torn, hostile)
        is skipped."""
        self.lines += 1
        try:
            record = _decode(line.decode())
            key = _key_of(record["key"])
            if record.get("dropped"):
                self._drop(key, int(record["offset"]))
                return
            added = (*key, int(record["size"]), int(record["mtime_ns"]),
                     int(record["ctime_ns"]), int(record["offset"]),
                     os.fsencode(record["path"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            return
        self._forget(key)
        self._at[key] = len(self._added)
        self._added.append(added)

    def _drop(self, key: Key, offset: int) -> None:
        at = self._at.get(key)
        if at is None:
            self.drops[key] = offset
        elif at >= 0 and self._added[at][5] == offset:  # type: ignore[index]
            self._forget(key)
            self._at[key] = -1

    def _forget(self, key: Key) -> None:
        at = self._at.get(key, -1)
        if at >= 0:
            self._added[at] = None

    def columns(self) -> Columns:
        """The entries the lines end with."""
        added = [entry for entry in self._added if entry is not None]
        try:
            return _as_columns(added)
        except OverflowError:  # a line with a number out of its column's range
            return _as_columns([entry for entry in added if _fits(entry)])


def _as_columns(added: list[tuple]) -> Columns:
    dev, ino, size, mtime, ctime, offset, paths = zip(*added, strict=True) if added else [()] * 7
    return Columns(array("Q", dev), array("Q", ino), array("q", size), array("q", mtime),
                   array("q", ctime), array("q", offset), array("I", map(len, paths)),
                   b"".join(paths))


def _fits(entry: tuple) -> bool:
    try:
        _as_columns([entry])
    except OverflowError:
        return False
    return True


def read(dir_fd: int) -> tuple[Columns | None, Iterator[bytes]]:
    """The checkpoint (None if there is none, or it is damaged: warned) and the change lines
    after it. A journal written before checkpoints existed is all change lines."""
    try:
        journal = open(JOURNAL, "rb", opener=_opener(dir_fd, os.O_RDONLY))  # noqa: SIM115
    except FileNotFoundError:
        return None, iter(())
    except OSError as e:  # such as a link in its place (ELOOP): replaced by the next checkpoint
        log.warning("cannot read the cache's journal %s (%s): starting cold", JOURNAL,
                    e.strerror)
        return None, iter(())
    first = journal.readline()
    try:
        header = json.loads(first)
        is_checkpoint = isinstance(header, dict) and "checkpoint" in header
    except ValueError:
        is_checkpoint = False
    if not is_checkpoint:
        journal.seek(0)
        return None, _lines(journal)
    try:
        return _columns(journal, header), _lines(journal)
    except (ValueError, TypeError, KeyError, EOFError, OverflowError, MemoryError) as e:
        log.warning("the cache's journal %s is damaged (%s): starting cold", JOURNAL, e)
        journal.close()
        return None, iter(())


def _lines(journal: BinaryIO) -> Iterator[bytes]:
    with journal:
        yield from journal


def _columns(journal: BinaryIO, header: dict) -> Columns:
    if header["checkpoint"] != _FORMAT or header["byteorder"] != sys.byteorder:
        raise ValueError(f"format {header['checkpoint']}, {header['byteorder']}-endian")
    count, path_bytes = int(header["entries"]), int(header["path_bytes"])
    if count < 0 or path_bytes < 0:
        raise ValueError("negative sizes")
    columns = {}
    crc = 0
    for name, code in _CODES:
        column = array(code)
        column.fromfile(journal, count)  # EOFError if the file is short
        crc = zlib.crc32(column, crc)
        columns[name] = column
    paths = journal.read(path_bytes)
    crc = zlib.crc32(paths, crc)
    if len(paths) != path_bytes or journal.read(1) != b"\n":
        raise EOFError("the checkpoint is cut short")
    if crc != header["crc32"] or sum(columns["path_len"]) != path_bytes:
        raise ValueError("checksum mismatch")
    return Columns(paths=paths, **columns)


def _opener(dir_fd: int, flags: int) -> Callable[[str, int], int]:
    return lambda name, _flags: os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                        dir_fd=dir_fd)


class Journal:
    """Appends change lines; writes checkpoints. A journal that cannot take a line (a full
    filesystem) is removed rather than left torn: a restart then starts cold instead of
    adopting on a guess."""

    def __init__(self, dir_fd: int, directory: str) -> None:
        self.dir_fd = dir_fd
        self.directory = directory
        self._fd = -1
        #: the journal could not be written: it is gone, and a restart starts cold
        self.lost = False

    def append(self, line: str) -> None:
        self.append_all([line])

    def append_all(self, lines: list[str]) -> None:
        """Lines (``added``, ``dropped``) in one write (nothing for none): a batch of fills
        ends in one system call."""
        if self.lost or not lines:
            return
        line = "".join(lines).encode()
        try:
            if self._fd < 0:
                self._fd = os.open(JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                   | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
            if os.write(self._fd, line) != len(line):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            self._lose(e)

    def checkpoint(self, columns: Columns) -> None:
        """Replace the journal by a checkpoint of ``columns`` (and no change lines)."""
        self.close()
        crc = 0
        for name, _code in _CODES:
            crc = zlib.crc32(getattr(columns, name), crc)
        header = {"checkpoint": _FORMAT, "entries": len(columns.dev),
                  "path_bytes": len(columns.paths), "byteorder": sys.byteorder,
                  "crc32": zlib.crc32(columns.paths, crc)}
        try:
            with contextlib.suppress(FileNotFoundError):  # a torn one: made anew, never reused
                os.unlink(_PART, dir_fd=self.dir_fd)
            with open(_PART, "wb", opener=_opener(self.dir_fd, os.O_WRONLY | os.O_CREAT
                                                  | os.O_EXCL)) as out:
                out.write((json.dumps(header) + "\n").encode())
                for name, _code in _CODES:
                    getattr(columns, name).tofile(out)
                out.write(columns.paths)
                out.write(b"\n")
            os.rename(_PART, JOURNAL, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            self.lost = False
        except OSError as e:
            self._lose(e)

    def _lose(self, error: OSError) -> None:
        self.lost = True
        self.close()
        for name in (JOURNAL, _PART):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.dir_fd)
        log.warning("cannot write the cache's journal in %s (%s): removed it; a restart with "
                    "--keep-cache will start cold", self.directory, error.strerror or error)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
