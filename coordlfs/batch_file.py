"""The staging area's batch files: a batch's tensor bytes as they are, behind a small header.

A shared job stages every batch it prepares for the others, and each of them maps every batch
it did not prepare: per batch, one write of its bytes and, per consumer, one map. ``torch.save``
costs ~3 times the write (zip framing and a CRC over every byte: ~22 ms of CPU for a 19 MB
float batch, against ~7 ms to write the bytes). Here the file is a header, the batch pickled
with each tensor replaced by where its bytes are (a persistent id, as ``torch.save`` does for
its storages), then the tensors' bytes, each at a 64-byte boundary. A consumer maps the file
copy-on-write and builds each tensor on the mapping with ``torch.frombuffer``: no copy, and
a consumer that changes a batch in place changes only its own pages.

A batch holding a tensor that is not a plain dense CPU tensor (sparse, quantized, a subclass,
with autograd history) has no such layout: it is staged as ``torch.save`` writes it, and read
back with ``torch.load`` (the file's first bytes tell which).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
from typing import Any

import torch

#: The first bytes of a raw batch file (``torch.save``'s files start with a zip header).
MAGIC = b"CLFSBAT1"
#: magic, then the pickle's length; the tensors' bytes start at the next 64-byte boundary
_HEADER = struct.Struct("<8sQ")
ALIGN = 64

def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _plain(t: torch.Tensor) -> bool:
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
            and not t.is_quantized and not t.requires_grad)


class _Placing(pickle.Pickler):
    """Pickles a batch with each tensor as (offset from the data's start, dtype, shape)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.slots: dict[int, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        self.end = 0
        self.raw = True

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if not _plain(obj):
            self.raw = False
            return None
        slot = self.slots.get(id(obj))
        if slot is None:  # a tensor twice in the batch is stored once
            slot = self.slots[id(obj)] = (self.end, obj.dtype, tuple(obj.shape))
            self.tensors.append(obj)
            self.end = _aligned(self.end + obj.numel() * obj.element_size())
        return slot


class BatchFile:
    """A batch laid out for its file: ``size`` bytes, to reserve before ``write``."""

    def __init__(self, batch: Any) -> None:
        buffer = io.BytesIO()
        placing = _Placing(buffer)
        placing.dump(batch)
        self._tensors = placing.tensors
        if placing.raw:
            pickled = buffer.getvalue()
            self._head = _HEADER.pack(MAGIC, len(pickled)) + pickled
            self._data = _aligned(len(self._head))
            self._offsets = [self._data + placing.slots[id(t)][0] for t in self._tensors]
            self.size = self._data + placing.end
        else:
            saved = io.BytesIO()
            torch.save(batch, saved)
            self._head, self._tensors, self._offsets = saved.getvalue(), [], []
            self.size = len(self._head)

    def write(self, path: str) -> None:
        """Write the file (created owner-only): the header, then each tensor's bytes."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.size)  # the gaps between tensors stay holes
            _write_at(fd, 0, self._head)
            for t, offset in zip(self._tensors, self._offsets, strict=True):
                if t.numel():
                    _write_at(fd, offset, _bytes_of(t))
        finally:
            os.close(fd)


class _Mapping(pickle.Unpickler):
    """Unpickles a batch, building each tensor on the file's mapping."""

    def __init__(self, file: io.BytesIO, mapping: mmap.mmap | None, data: int) -> None:
        super().__init__(file)
        self.mapping, self.data = mapping, data

    def persistent_load(self, pid: Any) -> torch.Tensor:
        offset, dtype, shape = pid
        numel = 1
        for n in shape:
            numel *= n
        if numel == 0 or self.mapping is None:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.mapping, dtype=dtype, count=numel,
                                offset=self.data + offset).view(shape)


def read(path: str) -> Any:
    """The batch in the file, its tensors on a private mapping of it (no copy)."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or not head.startswith(MAGIC):
            return torch.load(path, mmap=True, weights_only=False)
        _magic, length = _HEADER.unpack(head)
        pickled = f.read(length)
        data = _aligned(_HEADER.size + length)
        size = os.fstat(f.fileno()).st_size
        mapping = (mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
                   if size > data else None)
    return _Mapping(io.BytesIO(pickled), mapping, data).load()


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _write_at(fd: int, offset: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written

