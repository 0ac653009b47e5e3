"""An fsspec filesystem, protocol ``coordlfs``: libraries built on fsspec (zarr, pandas) read a
coordlfs mount through its client with a URL change (webdataset opens URLs itself:
``coordlfs.webdataset``; Hugging Face datasets resolves a ``data_dir`` as a local path and
refuses URLs offline, so it takes the plain mount path: README, "Native client and adapters").

    import fsspec
    with fsspec.open("coordlfs:///mnt/data/train/a/x.jpg") as f:   # an absolute path on a mount
        data = f.read()
    files = fsspec.open_files("coordlfs:///mnt/data/train/*/*.jpg")

Registered through the ``fsspec.specs`` entry point (``pip install coordlfs[fsspec]``), so
fsspec finds it without an import. Listings and metadata are the mount's (``os``: the
kernel caches them); file contents come through ``coordlfs.client`` (a hit is a view of the
cache's shared memory). A path on no coordlfs mount is read as a local file. Read-only: a
write, a new directory or a removal fails with EROFS.
"""

from __future__ import annotations

import errno
import os
import stat
from datetime import datetime, timezone
from typing import IO, Any, NoReturn

from fsspec import AbstractFileSystem

from coordlfs.client.adapters import open_binary, read_bytes


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    return "file" if stat.S_ISREG(mode) else "other"


class CoordlfsFileSystem(AbstractFileSystem):
    """Read-only access to coordlfs mounts, by absolute path (``coordlfs:///mnt/data/...``)."""

    protocol = "coordlfs"
    root_marker = "/"

    def _details(self, path: str, st: os.stat_result) -> dict[str, Any]:
        return {"name": path, "size": st.st_size, "type": _kind(st.st_mode),
                "mtime": st.st_mtime, "mode": st.st_mode, "ino": st.st_ino}

    def info(self, path: str, **_kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        return self._details(path, os.stat(path))

    def ls(self, path: str, detail: bool = True, **_kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            return [self._details(path, st) if detail else path]
        with os.scandir(path) as listing:
            entries = sorted(listing, key=lambda entry: entry.path)
        if not detail:
            return [entry.path for entry in entries]
        return [self._details(entry.path, entry.stat()) for entry in entries]

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["mtime"], tz=timezone.utc)

    def ukey(self, path: str) -> str:
        """Changes when the file does (what fsspec's caches key on)."""
        st = os.stat(self._strip_protocol(path))
        return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"

    def _open(self, path: str, mode: str = "rb", **_kwargs: Any) -> IO[bytes]:
        if mode != "rb":
            self._refuse(path)
        return open_binary(path)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **_kwargs: Any) -> bytes:
        data = read_bytes(self._strip_protocol(path))
        return bytes(data if start is None and end is None else data[start:end])

    def _refuse(self, path: str, *_args: Any, **_kwargs: Any) -> NoReturn:
        raise OSError(errno.EROFS, "coordlfs: the fsspec filesystem is read-only",
                      self._strip_protocol(path))

    mkdir = makedirs = rmdir = rm_file = touch = pipe_file = _refuse

    def cp_file(self, path1: str, path2: str, **_kwargs: Any) -> NoReturn:
        self._refuse(path2)

    def put_file(self, lpath: str, rpath: str, *_args: Any, **_kwargs: Any) -> NoReturn:
        self._refuse(rpath)

    def mv(self, path1: str, path2: str, *_args: Any, **_kwargs: Any) -> NoReturn:
        self._refuse(path1)
