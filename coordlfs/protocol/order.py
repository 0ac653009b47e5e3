"""The shared shuffle order of a seed-aligned group: a documented function any language can compute.

Jobs of a group read items in ``epoch_order(seed, epoch, n)``: the numbers ``0 .. n-1`` sorted
by ``(xxh64(le64(epoch) + le64(i), seed), i)``, where ``le64`` is the 8-byte little-endian
encoding and ``xxh64`` is XXH64 with the 64-bit ``seed``. A hash instead of a library's
random generator, so that PyTorch, TensorFlow or a shell script get the same order without
sharing an implementation of Mersenne Twister or PCG, and so that a new epoch gives a new
order from the same seed.

A job that itself runs on several ranks (DistributedSampler) reads ``shard``: the order padded
with its own head to a multiple of ``world_size`` (or cut, with ``drop_last``), then every
``world_size``-th item from ``rank``, as DistributedSampler does.

A prep group (``coordlfs.jobs.prep``) cuts each epoch's order into batches, as DataLoader does:
``batches_of``; ``batch_count`` is how many there are.
"""

from __future__ import annotations

import struct

import xxhash

SEED_LIMIT = 1 << 64


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """Items ``0 .. n-1`` in the order every member of the group reads them in ``epoch``."""
    if not 0 <= seed < SEED_LIMIT or epoch < 0 or n < 0:
        raise ValueError("seed must be in [0, 2**64), epoch and n must not be negative")
    prefix = struct.pack("<Q", epoch)
    keys = [xxhash.xxh64_intdigest(prefix + struct.pack("<Q", i), seed) for i in range(n)]
    return sorted(range(n), key=lambda i: (keys[i], i))


def shard(order: list[int], rank: int, world_size: int, drop_last: bool = False) -> list[int]:
    """The part of ``order`` that ``rank`` of ``world_size`` reads, as DistributedSampler splits."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) and world_size at least 1")
    if drop_last:
        total = len(order) // world_size * world_size
        padded = order[:total]
    else:
        total = -(-len(order) // world_size) * world_size
        padded = list(order)
        while len(padded) < total and order:
            padded += order[: total - len(padded)]
    return padded[rank:total:world_size]


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    """How many batches ``samples`` make: the last one short unless ``drop_last``."""
    full, rest = divmod(samples, batch_size)
    return full if drop_last or not rest else full + 1


def batches_of(order: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """An epoch's batches: the order cut into ``batch_size`` pieces, as a DataLoader does."""
    return [order[i * batch_size:(i + 1) * batch_size]
            for i in range(batch_count(len(order), batch_size, drop_last))]
