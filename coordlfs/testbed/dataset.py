"""Sample datasets for benchmarks: image-sized files in class folders, as ImageFolder expects.

Training sets such as ImageNet are many files of very different sizes (JPEGs of about 110 KB
on average, with a long tail), and a cache that admits whole files fills differently with such
a spread than with equal sizes, so sizes are lognormal. Names, sizes and contents depend only
on the spec, so runs are repeatable; a dataset already on disk is reused when its manifest
says it was made from the same spec (writing a few hundred MB is the slowest part of a demo).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordlfs.errors import UserError

#: The manifest at the dataset root; its presence marks the directory as ours to rewrite.
MANIFEST = ".coordlfs-dataset.json"
#: Bumped when the layout or contents made from a spec change, so old datasets are remade.
FORMAT = 1


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """What to generate: ``files`` files of mean size ``mean_bytes`` in ``classes`` folders."""

    files: int
    mean_bytes: int = 110_000
    #: spread of the lognormal; 0.6 gives a median of ~92 KB and a 99th percentile ~3.4x mean
    sigma: float = 0.6
    classes: int = 10
    seed: int = 0

    def check(self) -> None:
        if self.files < 1 or self.classes < 1 or self.mean_bytes < 1 or self.sigma < 0:
            raise UserError(f"bad dataset spec {self}: files, classes and mean size must be "
                            "positive, sigma not negative")

    def layout(self) -> list[tuple[str, int]]:
        """(relative path, size) of every file, in order; the same for the same spec."""
        rng = random.Random(self.seed)
        mu = math.log(self.mean_bytes) - self.sigma ** 2 / 2  # so that the mean is mean_bytes
        width = len(str(self.classes - 1))
        return [(f"class{i % self.classes:0{width}d}/img{i:06d}.bin",
                 max(1, round(rng.lognormvariate(mu, self.sigma))))
                for i in range(self.files)]


@dataclass(frozen=True, slots=True)
class Dataset:
    """A generated dataset on disk."""

    root: Path
    #: what it was made from: a DatasetSpec, or ``coordlfs.bench.jpegs.ImageSpec``
    spec: Any
    files: tuple[tuple[str, int], ...]
    #: True when an existing dataset was found intact and nothing was written
    reused: bool

    @property
    def total_bytes(self) -> int:
        return sum(size for _rel, size in self.files)

    def bytes_of(self, rels: Iterable[str]) -> int:
        """The bytes of some of its files, by relative path."""
        sizes = dict(self.files)
        return sum(sizes[rel] for rel in rels)

    def paths(self, base: str | os.PathLike[str] | None = None) -> list[str]:
        """Absolute paths of the files under ``base`` (default: the dataset root), e.g. a mount."""
        prefix = os.fspath(base if base is not None else self.root)
        return [os.path.join(prefix, rel) for rel, _size in self.files]


def file_contents(spec: DatasetSpec, rel: str, size: int) -> bytes:
    """Incompressible bytes for one file, seeded by its name so files are independent."""
    return random.Random(f"{spec.seed}:{rel}").randbytes(size)


def _manifest(spec: DatasetSpec, complete: bool, total: int) -> dict:
    return {"format": FORMAT, "spec": asdict(spec), "complete": complete, "bytes": total}


def read_manifest(root: Path) -> dict | None:
    try:
        return json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return {}  # ours (the name says so) but damaged: remake


def write_manifest(root: Path, manifest: dict) -> None:
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, root / MANIFEST)


def intact(root: Path, layout: list[tuple[str, int]]) -> bool:
    for rel, size in layout:
        try:
            if (root / rel).stat().st_size != size:
                return False
        except FileNotFoundError:
            return False
    return True


def clear_dataset(root: Path) -> None:
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def ensure_dataset(root: str | os.PathLike[str], spec: DatasetSpec) -> Dataset:
    """The dataset of ``spec`` at ``root``: reused if intact, else (re)generated.

    A directory that holds anything but a dataset of ours is never touched (UserError).
    The manifest is written first as incomplete and marked complete last, so a run that was
    interrupted half-way is recognised and remade.
    """
    spec.check()
    root = Path(root)
    layout = spec.layout()
    total = sum(size for _rel, size in layout)
    manifest = read_manifest(root)
    if manifest == _manifest(spec, True, total) and intact(root, layout):
        return Dataset(root, spec, tuple(layout), reused=True)
    rewrite(root, manifest, _manifest(spec, False, total),
            ((rel, file_contents(spec, rel, size)) for rel, size in layout))
    write_manifest(root, _manifest(spec, True, total))
    return Dataset(root, spec, tuple(layout), reused=False)


def rewrite(root: Path, manifest: dict | None, begun: dict,
            files: Iterable[tuple[str, bytes]]) -> list[tuple[str, int]]:
    """Replace a dataset of ours at ``root`` (``manifest``: what it holds, None if nothing of
    ours) with ``files`` (relative path, contents), with ``begun`` as the manifest while they
    are written; returns (relative path, size) of each. The caller then writes the complete
    manifest. A directory that holds anything but a dataset of ours is never touched."""
    if manifest is None and root.is_dir() and any(root.iterdir()):
        raise UserError(f"{root} is not empty and holds no coordlfs sample dataset; "
                        "choose another directory")
    root.mkdir(parents=True, exist_ok=True)
    clear_dataset(root)
    write_manifest(root, begun)
    written = []
    for rel, data in files:
        path = root / rel
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        written.append((rel, len(data)))
    return written


def epoch_orders(dataset: Dataset, epochs: int, seed: int) -> list[list[str]]:
    """A new random order of the dataset's files for each epoch, the same for the same seed."""
    rng = random.Random(seed)
    orders = []
    for _ in range(epochs):
        order = [rel for rel, _size in dataset.files]
        rng.shuffle(order)
        orders.append(order)
    return orders
