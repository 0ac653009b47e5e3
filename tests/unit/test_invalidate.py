"""Dropping the kernel's attributes of an inode the kernel may have forgotten meanwhile.

A daemon's log in the full suite showed ``handling changes of the source failed`` with
``fuse_lowlevel_notify_inval_inode returned: No such file or directory``: the watch saw a file
change, ``Operations.changed_open`` found an open file reading it, and by the time it asked
the kernel to drop the inode's attributes, the kernel had forgotten the inode (its reader had
closed). Nothing was left to drop; the error failed the watcher's batch."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pyfuse3
import pytest

from coordlfs.fs.operations import Operations


def _raising(code: int):
    def invalidate(inode: int, attr_only: bool = False) -> None:
        raise OSError(code, "fuse_lowlevel_notify_inval_inode returned: " + errno.errorcode[code])
    return invalidate


def test_an_inode_the_kernel_forgot_meanwhile_is_nothing_to_drop(monkeypatch) -> None:
    monkeypatch.setattr(pyfuse3, "invalidate_inode", _raising(errno.ENOENT))
    ops = SimpleNamespace(opens=SimpleNamespace(reading_now=lambda path: [5, 6]))
    Operations.changed_open(ops, b"a/file")  # type: ignore[arg-type]


def test_another_failure_to_drop_attributes_still_raises(monkeypatch) -> None:
    monkeypatch.setattr(pyfuse3, "invalidate_inode", _raising(errno.EIO))
    ops = SimpleNamespace(opens=SimpleNamespace(reading_now=lambda path: [5]))
    with pytest.raises(OSError) as raised:
        Operations.changed_open(ops, b"a/file")  # type: ignore[arg-type]
    assert raised.value.errno == errno.EIO
