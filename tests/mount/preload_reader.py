"""A job for the preload library's tests, run under ``coordlfs run``: reads files of a mount
the ways real jobs do and prints, as JSON, each file's digest (or the errno its open met)
and whether the library was loaded.

    preload_reader.py MODE ROOT NAME...

Modes: ``open`` (Python's open: open64 + read), ``os`` (os.open / os.read), ``fopen`` (libc's
fopen/fread/fclose through ctypes), ``mmap`` (a mapping of st_size bytes, as numpy.memmap
makes), ``numpy`` (numpy.memmap), ``threads`` (``open`` in 4 threads), ``fork`` (``open``
in a forked child), ``exec`` (``cat`` of each file, exec'd by a child), ``pil`` (each file
decoded as an image in a torch DataLoader with 2 workers).
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import xxhash


def digest(data: bytes) -> str:
    return xxhash.xxh64_hexdigest(data)


def by_open(path: str) -> str:
    with open(path, "rb") as f:
        return digest(f.read())


def by_os(path: str) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return digest(b"".join(chunks))
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fopen.restype = ctypes.c_void_p
_libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
_libc.fread.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
_libc.fclose.argtypes = [ctypes.c_void_p]


def by_fopen(path: str) -> str:
    stream = _libc.fopen(os.fsencode(path), b"rb")
    if not stream:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    try:
        buf = ctypes.create_string_buffer(1 << 20)
        chunks = []
        while got := _libc.fread(buf, 1, len(buf), stream):
            chunks.append(buf.raw[:got])
        return digest(b"".join(chunks))
    finally:
        _libc.fclose(stream)


def by_mmap(path: str) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return digest(b"")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            return digest(mapped[:])
    finally:
        os.close(fd)


def by_numpy(path: str) -> str:
    import numpy

    return digest(numpy.memmap(path, dtype=numpy.uint8, mode="r").tobytes())


def by_exec(path: str) -> str:
    return digest(subprocess.run(["cat", path], capture_output=True, check=True).stdout)


def one(read: Callable[[str], str], path: str) -> str:
    try:
        return read(path)
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))


def in_threads(paths: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}

    def work(share: list[str]) -> None:
        for path in share:
            out[path] = one(by_open, path)

    threads = [threading.Thread(target=work, args=(paths[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def in_fork(paths: list[str]) -> dict[str, str]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        with os.fdopen(write_end, "w") as f:
            json.dump({p: one(by_open, p) for p in paths}, f)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        out = json.load(f)
    os.waitpid(pid, 0)
    return out


def by_pil(paths: list[str]) -> dict[str, str]:
    import torch.utils.data
    from PIL import Image

    class Images(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> tuple[str, str]:
            with Image.open(paths[i]) as image:
                return paths[i], digest(image.convert("RGB").tobytes())

    loader = torch.utils.data.DataLoader(Images(), batch_size=None, num_workers=2)
    return dict(loader)


READS: dict[str, Callable[[str], str]] = {"open": by_open, "os": by_os, "fopen": by_fopen,
                                          "mmap": by_mmap, "numpy": by_numpy, "exec": by_exec}
GROUPS: dict[str, Callable[[list[str]], dict[str, str]]] = {
    "threads": in_threads, "fork": in_fork, "pil": by_pil}


def main() -> None:
    mode, root, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    paths = [os.path.join(root, name) for name in names]
    read = READS.get(mode)
    found = GROUPS[mode](paths) if read is None else {p: one(read, p) for p in paths}
    with open("/proc/self/maps") as f:
        loaded = "libcoordlfs-preload" in f.read()
    json.dump({"digests": {os.path.relpath(p, root): d for p, d in found.items()},
               "preloaded": loaded}, sys.stdout)


if __name__ == "__main__":
    main()
