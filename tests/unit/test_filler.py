"""The fill process (``coordlfs.cache.filler``): a real process, real files, the daemon's end
driven from trio as the daemon drives it."""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trio
import xxhash

from coordlfs.cache.fill_process import FILL_CHUNK, Stat, file_name
from coordlfs.cache.filler import Filler, Pending
from coordlfs.source.source import Version


class Tree:
    def __init__(self, root: Path) -> None:
        self.src = root / "src"
        self.files = root / "files"
        self.src.mkdir()
        self.files.mkdir(mode=0o700)
        self.root_fd = os.open(self.src, os.O_PATH | os.O_DIRECTORY)
        self.files_fd = os.open(self.files, os.O_PATH | os.O_DIRECTORY)

    def close(self) -> None:
        os.close(self.root_fd)
        os.close(self.files_fd)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    t = Tree(tmp_path)
    try:
        yield t
    finally:
        t.close()


def serving(tree: Tree, body: Callable[[Filler], Awaitable[None]]) -> None:
    filler = Filler(tree.root_fd, tree.files_fd, 2)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(filler.run)
            await body(filler)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        filler.close()
    assert filler.process.poll() is not None  # gone with the daemon's end


def digest(path: Path) -> str:
    return xxhash.xxh64_hexdigest(path.read_bytes())


def test_a_file_opened_and_copied_is_the_source_byte_for_byte(tree: Tree) -> None:
    data = os.urandom(3 * FILL_CHUNK + 4321)  # a large one: progress between its chunks
    (tree.src / "a").write_bytes(data)
    progress: list[int] = []

    async def body(filler: Filler) -> None:
        ident, opened = filler.open(b"a")
        st = await opened.wait()
        assert st.st_size == len(data) and st.st_ino == os.stat(tree.src / "a").st_ino
        final = await filler.copy(ident, 7, progress.append).wait()
        assert final == st

    serving(tree, body)
    assert digest(tree.files / file_name(7)) == xxhash.xxh64_hexdigest(data)
    assert (tree.files / file_name(7)).stat().st_mode & 0o777 == 0o600
    assert progress == [FILL_CHUNK, 2 * FILL_CHUNK, 3 * FILL_CHUNK]


def test_a_file_behind_its_reader_is_copied_only_at_the_version_asked(tree: Tree) -> None:
    (tree.src / "b").write_bytes(os.urandom(100_000))
    st = os.stat(tree.src / "b")
    stale = Version(st.st_ino, st.st_size, st.st_mtime_ns + 1, st.st_ctime_ns)
    ended: dict[int, Pending] = {}

    async def body(filler: Filler) -> None:
        for number, path, version in ((1, b"b", Version.of(st)), (2, b"b", stale),
                                      (3, b"missing", Version.of(st))):
            filler.behind(path, number, version, lambda p, n=number: ended.__setitem__(n, p))
        while len(ended) < 3:
            await trio.sleep(0.01)

    serving(tree, body)
    assert isinstance(ended[1].reply, Stat) and ended[1].error is None
    assert digest(tree.files / file_name(1)) == digest(tree.src / "b")
    assert ended[2].error is not None and ended[2].error.errno == errno.ESTALE
    assert ended[3].error is not None and ended[3].error.errno == errno.ENOENT
    assert not (tree.files / file_name(2)).exists()


def test_a_link_or_a_path_out_of_the_source_is_never_opened(tree: Tree, tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"not the source's")
    os.symlink(tmp_path / "secret", tree.src / "link")
    results: list[int] = []

    async def body(filler: Filler) -> None:
        for path in (b"link", b"../secret"):
            _ident, opened = filler.open(path)
            with pytest.raises(OSError) as caught:
                await opened.wait()
            results.append(caught.value.errno)

    serving(tree, body)
    assert results == [errno.ELOOP, errno.EXDEV]


def test_a_filler_that_dies_fails_what_it_had_and_another_starts(tree: Tree) -> None:
    (tree.src / "c").write_bytes(b"c" * 5000)

    async def body(filler: Filler) -> None:
        first = filler.process
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        with trio.fail_after(10):
            while filler.process is first:
                await trio.sleep(0.05)
        ident, opened = filler.open(b"c")
        assert (await opened.wait()).st_size == 5000
        await filler.copy(ident, 9, lambda _done: None).wait()
        assert filler.started == 2

    serving(tree, body)
    assert (tree.files / file_name(9)).read_bytes() == b"c" * 5000


def test_more_requests_at_once_than_the_socket_queues_are_all_answered(tree: Tree) -> None:
    """An AF_UNIX datagram socket queues 10 datagrams (``net.unix.max_dgram_qlen``): the
    rest wait in the daemon's outbox, none fails."""
    for i in range(200):
        (tree.src / f"f{i}").write_bytes(bytes([i]) * 3000)
    ended: list[Pending] = []

    async def body(filler: Filler) -> None:
        for i in range(200):
            st = os.stat(tree.src / f"f{i}")
            filler.behind(b"f%d" % i, i, Version.of(st), ended.append)
        with trio.fail_after(30):
            while len(ended) < 200:
                await trio.sleep(0.01)

    serving(tree, body)
    assert [p.error for p in ended if p.error is not None] == []
    assert all((tree.files / file_name(i)).read_bytes() == bytes([i]) * 3000
               for i in range(200))
