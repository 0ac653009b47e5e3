"""The staging area's batch files: a batch's tensor bytes as they are, behind a small header.

A shared job stages every batch it prepares for the others, and each of them maps every batch
it did not prepare: per batch, one write of its bytes and, per consumer, one map. ``torch.save``
costs ~3 times the write (zip framing and a CRC over every byte: ~22 ms of CPU for a 19 MB
float batch, against ~7 ms to write the bytes). Here the file is a header, then the tensors'
bytes, each at a 64-byte boundary. A consumer maps the file copy-on-write and builds each
tensor on the mapping with ``torch.frombuffer``: no copy, and a consumer that changes a batch
in place changes only its own pages.

The header is JSON: the batch's structure (lists, tuples, named tuples, dicts with str or
int keys, None, bools, ints, floats, str, bytes) with each tensor as where its bytes are, its
dtype and shape. It carries no code, so a file someone else put in the staging area can at
worst be refused, never run anything as its reader (a pickle, or ``torch.load`` without
``weights_only``, runs what the file says). A named tuple is rebuilt only as a class the
reader has loaded already, without calling any of its code. Anything else (sparse, quantized
or autograd tensors, tensor subclasses, other objects) cannot be staged: ``Unstageable``,
and the job prepares its batches alone.
"""

from __future__ import annotations

import base64
import inspect
import json
import math
import mmap
import os
import stat
import struct
import sys
from typing import Any

import torch

#: The first bytes of a batch file.
MAGIC = b"CLFSBAT2"
#: magic, then the JSON header's length; the tensors' bytes start at the next 64-byte boundary
_HEADER = struct.Struct("<8sQ")
ALIGN = 64
#: the largest header a reader takes: a batch's structure, not its bytes
MAX_HEADER = 64 << 20
#: every dtype by its name (``float32``): the only dtypes a header may name
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values()
           if isinstance(d, torch.dtype)}
#: the tags of the header's JSON arrays: ["l", ...] a list, ["t", ...] a tuple,
#: ["n", module, qualname, ...] a named tuple, ["d", k, v, ...] a dict, ["T", i] tensor i,
#: ["b", base64] bytes, ["f", "nan"] a float JSON has no number for; every other value is
#: itself
_LIST, _TUPLE, _NAMED, _DICT, _TENSOR, _BYTES, _FLOAT = "l", "t", "n", "d", "T", "b", "f"


class Unstageable(ValueError):
    """The batch holds something a batch file cannot carry (the message says what)."""


class BadBatchFile(ValueError):
    """A file that is no batch file this reader can take (the message says why)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _odd(t: torch.Tensor) -> str | None:
    """Why a tensor has no plain layout of bytes to stage, or None."""
    if type(t) is not torch.Tensor:
        return f"a tensor subclass ({type(t).__name__})"
    if t.layout != torch.strided or t.is_nested:
        return f"a {t.layout} tensor"
    if t.is_quantized:
        return "a quantized tensor"
    if t.device.type != "cpu":
        return f"a tensor on {t.device}"
    if t.requires_grad:
        return "a tensor that requires grad"
    return None


class _Describing:
    """The batch as the header's JSON value, its tensors listed once each."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.places: list[list] = []
        self._index: dict[int, int] = {}
        self.end = 0

    def value(self, obj: Any) -> Any:
        kind = type(obj)
        if obj is None or kind in (bool, int, str):
            return obj
        if kind is float:
            return obj if math.isfinite(obj) else [_FLOAT, repr(obj)]
        if kind is list:
            return [_LIST, *map(self.value, obj)]
        if kind is tuple:
            return [_TUPLE, *map(self.value, obj)]
        if kind is dict:
            return [_DICT, *(x for k, v in obj.items() for x in (self._key(k), self.value(v)))]
        if kind is bytes:
            return [_BYTES, base64.b64encode(obj).decode()]
        if isinstance(obj, torch.Tensor):
            return [_TENSOR, self._tensor(obj)]
        if isinstance(obj, tuple) and _named_tuple_class(kind.__module__, kind.__qualname__):
            return [_NAMED, kind.__module__, kind.__qualname__, *map(self.value, obj)]
        raise Unstageable(f"it holds a {kind.__module__}.{kind.__qualname__}")

    @staticmethod
    def _key(key: Any) -> str | int:
        if type(key) not in (str, int):
            raise Unstageable(f"it holds a dict with a {type(key).__name__} key")
        return key

    def _tensor(self, t: torch.Tensor) -> int:
        why = _odd(t)
        if why is not None:
            raise Unstageable(f"it holds {why}")
        index = self._index.get(id(t))
        if index is None:  # a tensor twice in the batch is stored once
            index = self._index[id(t)] = len(self.tensors)
            self.tensors.append(t)
            self.places.append([self.end, str(t.dtype).removeprefix("torch."), list(t.shape)])
            self.end = _aligned(self.end + t.numel() * t.element_size())
        return index


class BatchFile:
    """A batch laid out for its file: ``size`` bytes, to reserve before ``write``. Raises
    Unstageable for a batch no batch file can carry."""

    def __init__(self, batch: Any) -> None:
        describing = _Describing()
        header = json.dumps({"batch": describing.value(batch), "tensors": describing.places},
                            separators=(",", ":"), allow_nan=False).encode()
        self._head = _HEADER.pack(MAGIC, len(header)) + header
        self._data = _aligned(len(self._head))
        self._tensors = describing.tensors
        self._offsets = [self._data + place[0] for place in describing.places]
        self.size = self._data + describing.end

    def write(self, path: str) -> None:
        """Write the file, created owner-only; never over an existing file, never through a
        link."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.ftruncate(fd, self.size)  # the gaps between tensors stay holes
            _write_at(fd, 0, self._head)
            for t, offset in zip(self._tensors, self._offsets, strict=True):
                if t.numel():
                    _write_at(fd, offset, _bytes_of(t))
        finally:
            os.close(fd)


def read(path: str) -> Any:
    """The batch in the file, its tensors on a private mapping of it (no copy). Raises
    BadBatchFile for a file that is not one (or not this user's), OSError if it cannot be
    read; runs nothing the file says."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            # a prep group's jobs are one user's: another's file was not staged by them
            raise BadBatchFile(f"{path} is not a file of uid {os.geteuid()}'s")
        head = os.pread(fd, _HEADER.size, 0)
        magic, length = _HEADER.unpack(head) if len(head) == _HEADER.size else (b"", 0)
        if magic != MAGIC or length > min(MAX_HEADER, st.st_size - _HEADER.size):
            raise BadBatchFile(f"{path} is not a coordlfs batch file")
        header = os.pread(fd, length, _HEADER.size)
        data = _aligned(_HEADER.size + length)
        mapping = (mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
                   if st.st_size > data else None)
    finally:
        os.close(fd)
    try:
        described = json.loads(header)
        tensors = [_Tensor(place, data, st.st_size) for place in described["tensors"]]
        return _Building(tensors, mapping).value(described["batch"])
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, RuntimeError) as e:
        raise BadBatchFile(f"{path} is not a coordlfs batch file: {e}") from None


class _Tensor:
    """One tensor of the header, checked to lie within the file."""

    def __init__(self, place: Any, data: int, size: int) -> None:
        offset, dtype, shape = place
        self.dtype = _DTYPES[dtype]
        if type(offset) is not int or offset < 0 or not all(
                type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"a tensor at {offset!r} of shape {shape!r}")
        self.shape, self.offset = tuple(shape), data + offset
        self.count = math.prod(self.shape)
        if self.offset + self.count * self.dtype.itemsize > size:
            raise ValueError("a tensor past the file's end")
        self.built: torch.Tensor | None = None


class _Building:
    """The batch from the header's JSON value, each tensor on the file's mapping."""

    def __init__(self, tensors: list[_Tensor], mapping: mmap.mmap | None) -> None:
        self.tensors, self.mapping = tensors, mapping

    def value(self, node: Any) -> Any:
        if type(node) is not list:
            if node is None or type(node) in (bool, int, float, str):
                return node
            raise ValueError(f"a {type(node).__name__} in the batch")
        tag, *items = node
        if tag == _LIST:
            return [self.value(x) for x in items]
        if tag == _TUPLE:
            return tuple(self.value(x) for x in items)
        if tag == _DICT:
            if len(items) % 2 or not all(type(k) in (str, int) for k in items[::2]):
                raise ValueError("a dict with an odd key")
            return {k: self.value(v) for k, v in zip(items[::2], items[1::2], strict=True)}
        if tag == _TENSOR:
            return self._tensor(*items)
        if tag == _BYTES:
            return base64.b64decode(*items, validate=True)
        if tag == _FLOAT and items in (["inf"], ["-inf"], ["nan"]):
            return float(*items)
        if tag == _NAMED:
            module, qualname, *fields = items
            cls = _named_tuple_class(module, qualname)
            if cls is None or len(fields) != len(cls._fields):
                raise ValueError(f"no named tuple {module}.{qualname} of {len(fields)} fields "
                                 "loaded here")
            return tuple.__new__(cls, [self.value(x) for x in fields])
        raise ValueError(f"an unknown tag {tag!r}")

    def _tensor(self, index: int) -> torch.Tensor:
        if type(index) is not int or index < 0:
            raise ValueError(f"a tensor numbered {index!r}")
        t = self.tensors[index]
        if t.built is None:
            if t.count == 0 or self.mapping is None:
                t.built = torch.empty(t.shape, dtype=t.dtype)
            else:
                t.built = torch.frombuffer(self.mapping, dtype=t.dtype, count=t.count,
                                           offset=t.offset).view(t.shape)
        return t.built


def _named_tuple_class(module: Any, qualname: Any) -> type | None:
    """The named tuple class ``module.qualname`` if this process has loaded it, found without
    importing anything or running any of its code (a header names it; it is not trusted)."""
    if type(module) is not str or type(qualname) is not str:
        return None
    found: Any = sys.modules.get(module)
    for name in qualname.split("."):
        found = inspect.getattr_static(found, name, None)
    if (isinstance(found, type) and type(found) is type and issubclass(found, tuple)
            and isinstance(inspect.getattr_static(found, "_fields", None), tuple)):
        return found
    return None


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _write_at(fd: int, offset: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
