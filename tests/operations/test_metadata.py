"""Lookups, attributes, listings, lookup counts and refusals of ``Operations``, in-process."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyfuse3
import pytest
from inprocess import ctx, is_dir, mounted, write_files

from coordlfs import CONTROL_NAME
from coordlfs.fs.inodes import CONTROL_INODE, ROOT_INODE


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    write_files(root, {"a.bin": 1000, "b.bin": 2000, "sub/c.bin": 3000})
    return root


def errno_of(excinfo: pytest.ExceptionInfo[pyfuse3.FUSEError]) -> int:
    return excinfo.value.errno


def test_lookups_are_counted_and_forgotten(source: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted(source, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            first = await m.ops.lookup(ROOT_INODE, b"a.bin", ctx())
            again = await m.ops.lookup(ROOT_INODE, b"a.bin", ctx())
            inode = first.st_ino
            assert again.st_ino == inode and first.st_size == 1000
            assert m.ops.inodes[inode].lookups == 2
            assert (await m.ops.getattr(inode, ctx())).st_size == 1000
            sub = await m.lookup("sub/c.bin")
            assert sub.st_size == 3000 and is_dir(await m.lookup("sub"))
            missing = await m.ops.lookup(ROOT_INODE, b"nothing", ctx())
            assert missing.st_ino == 0  # a negative entry, cached by the kernel
            m.ops.forget([(inode, 1)])
            assert m.ops.inodes[inode].lookups == 1
            m.ops.forget([(inode, 1)])
            with pytest.raises(pyfuse3.FUSEError) as gone:
                await m.ops.getattr(inode, ctx())
            assert errno_of(gone) == errno.ESTALE
            assert (await m.lookup("a.bin")).st_ino != inode  # a new inode, counted anew

        m.run(body)


def test_the_control_entry_is_found_but_never_listed(source: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted(source, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            attr = await m.ops.lookup(ROOT_INODE, os.fsencode(CONTROL_NAME), ctx())
            assert attr.st_ino == CONTROL_INODE
            fh = await m.ops.opendir(ROOT_INODE, ctx())
            await m.ops.readdir(fh, 0, None)
            await m.ops.releasedir(fh)
            names = [name for name, _inode, _next in m.kernel.listed]
            assert names == [b".", b"..", b"a.bin", b"b.bin", b"sub"]
            assert os.fsencode(CONTROL_NAME) not in names

        m.run(body)


def test_readdir_counts_a_lookup_only_for_entries_the_kernel_took(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted(source, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            fh = await m.ops.opendir(ROOT_INODE, ctx())
            m.kernel.room = 3  # ".", ".." and one entry fit in the kernel's buffer
            await m.ops.readdir(fh, 0, None)
            assert [n for n, _i, _next in m.kernel.listed] == [b".", b"..", b"a.bin"]
            listed = {name: inode for name, inode, _next in m.kernel.listed}
            assert listed[b"."] == listed[b".."] == ROOT_INODE
            assert m.ops.inodes[listed[b"a.bin"]].lookups == 1
            refused = len(m.ops.inodes)
            m.kernel.room = None  # the kernel asks again from where it stopped
            await m.ops.readdir(fh, m.kernel.listed[-1][2], None)
            await m.ops.releasedir(fh)
            names = [n for n, _i, _next in m.kernel.listed]
            assert names == [b".", b"..", b"a.bin", b"b.bin", b"sub"]
            assert len(m.ops.inodes) == refused + 2  # b.bin was not kept while refused
            for name, inode, _next in m.kernel.listed[2:]:
                assert m.ops.inodes[inode].lookups == 1, name

        m.run(body)


def test_writes_are_refused_read_only(source: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted(source, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            inode = (await m.lookup("a.bin")).st_ino
            refusals = [
                m.ops.open(inode, os.O_WRONLY, ctx()),
                m.ops.open(inode, os.O_RDWR, ctx()),
                m.ops.open(inode, os.O_RDONLY | os.O_TRUNC, ctx()),
                m.ops.setattr(inode, None, None, None, ctx()),
                m.ops.access(inode, os.W_OK, ctx()),
                m.ops.mkdir(ROOT_INODE, b"d", 0o755, ctx()),
                m.ops.unlink(ROOT_INODE, b"a.bin", ctx()),
                m.ops.create(ROOT_INODE, b"new", 0o644, os.O_WRONLY, ctx()),
                m.ops.rename(ROOT_INODE, b"a.bin", ROOT_INODE, b"z", 0, ctx()),
            ]
            for call in refusals:
                with pytest.raises(pyfuse3.FUSEError) as refused:
                    await call
                assert errno_of(refused) == errno.EROFS
            fh = await m.open("a.bin")
            with pytest.raises(pyfuse3.FUSEError) as refused:
                await m.ops.write(fh, 0, b"x")
            assert errno_of(refused) == errno.EROFS
            await m.ops.release(fh)
            assert await m.ops.access(inode, os.R_OK, ctx())

        m.run(body)


def test_an_inode_the_kernel_forgot_is_stale(source: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with mounted(source, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            for call in (m.ops.getattr(999, ctx()), m.ops.open(999, os.O_RDONLY, ctx()),
                         m.ops.opendir(999, ctx()), m.ops.lookup(999, b"a.bin", ctx())):
                with pytest.raises(pyfuse3.FUSEError) as stale:
                    await call
                assert errno_of(stale) == errno.ESTALE

        m.run(body)


def test_opening_a_directory_or_a_symlink_is_refused(source: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (source / "link").symlink_to("a.bin")
    with mounted(source, tmp_path / "cache", monkeypatch) as m:
        async def body() -> None:
            for name, code in (("sub", errno.EISDIR), ("link", errno.EINVAL)):
                inode = (await m.lookup(name)).st_ino
                with pytest.raises(pyfuse3.FUSEError) as refused:
                    await m.ops.open(inode, os.O_RDONLY, ctx())
                assert errno_of(refused) == code
            assert await m.ops.readlink((await m.lookup("link")).st_ino, ctx()) == b"a.bin"

        m.run(body)
