"""Generated JPEGs in class folders and the image pipeline a training job runs over them.

``bench hpsearch`` measures what fetching *and pre-processing* cost N jobs that each do both,
so the items must be real JPEGs and the pipeline a real one: decode, random resized crop,
random flip, normalise, as torchvision's ImageNet recipe does, per item, on the CPU. Contents
are smooth colour fields with blurred noise blended in, seeded by the spec and the file's
name, so files compress to tens of KB (not to almost nothing, as flat images would), with a
spread; a dataset on disk is reused when its manifest says it was made from the same spec.

The pipeline is written against Pillow and torch alone (``torch.frombuffer``, no numpy, no
torchvision: there is no CPU build of torchvision here). Its randomness comes from Python's
``random`` module, which DataLoader seeds in every worker for every epoch.
"""

from __future__ import annotations

import io
import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from PIL import Image, ImageFilter
from torch.utils.data import Dataset as TorchDataset

from coordlfs.client.adapters import open_binary
from coordlfs.errors import UserError
from coordlfs.testbed.dataset import Dataset, intact, read_manifest, rewrite, write_manifest

#: Bumped when the images made from a spec change, so old datasets are remade.
FORMAT = 1
#: What the manifest's ``kind`` says, so a byte dataset of ``bench epochs`` is never taken.
KIND = "jpeg"
#: torchvision's RandomResizedCrop defaults: share of the area, and aspect ratio.
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
#: The ImageNet channel means and standard deviations every torchvision recipe normalises by.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
_MEAN = torch.tensor(MEAN).view(3, 1, 1)
_STD = torch.tensor(STD).view(3, 1, 1)


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """``files`` JPEGs of ``width`` x ``height`` in ``classes`` folders."""

    files: int
    width: int
    height: int
    classes: int = 10
    seed: int = 0
    quality: int = 90

    def check(self) -> None:
        if min(self.files, self.width, self.height, self.classes) < 1:
            raise UserError(f"bad image dataset {self.files}:{self.width}x{self.height}: "
                            "count, width and height must be positive")

    def names(self) -> list[str]:
        """The relative path of every image, in order: ``class003/img00042.jpg``."""
        cw, iw = max(3, len(str(self.classes - 1))), max(5, len(str(self.files - 1)))
        return [f"class{i % self.classes:0{cw}d}/img{i:0{iw}d}.jpg" for i in range(self.files)]


def render(spec: ImageSpec, rel: str) -> bytes:
    """The JPEG of one file: a colour field (an upscaled grid of random colours blended with
    a rotated gradient) with blurred noise of a random strength on top; seeded by its name."""
    rng = random.Random(f"{spec.seed}:{rel}")
    w, h = spec.width, spec.height
    sw, sh = max(1, w // 16), max(1, h // 16)
    field = Image.frombytes("RGB", (sw, sh), rng.randbytes(3 * sw * sh))
    field = field.resize((w, h), Image.Resampling.BICUBIC)
    gradient = Image.linear_gradient("L").rotate(rng.uniform(0, 360)).resize((w, h))
    field = Image.blend(field, Image.merge("RGB", [gradient] * 3), 0.3)
    noise = Image.frombytes("RGB", (w, h), rng.randbytes(3 * w * h))
    noise = noise.filter(ImageFilter.GaussianBlur(rng.uniform(0.4, 1.2)))
    out = io.BytesIO()
    Image.blend(field, noise, rng.uniform(0.1, 0.5)).save(out, "JPEG", quality=spec.quality)
    return out.getvalue()


def _manifest(spec: ImageSpec, files: list[tuple[str, int]] | None) -> dict:
    return {"format": FORMAT, "kind": KIND, "spec": asdict(spec), "complete": files is not None,
            "files": files or []}


def _listed(manifest: dict | None, spec: ImageSpec) -> list[tuple[str, int]] | None:
    """The files a complete manifest of ``spec`` lists, else None."""
    if not manifest or not manifest.get("complete"):
        return None
    if {key: manifest.get(key) for key in ("format", "kind", "spec")} != \
            {"format": FORMAT, "kind": KIND, "spec": asdict(spec)}:
        return None
    files = [(rel, size) for rel, size in manifest.get("files", [])]
    return files if [rel for rel, _size in files] == spec.names() else None


def ensure_jpegs(root: str | os.PathLike[str], spec: ImageSpec) -> Dataset:
    """The dataset of ``spec`` at ``root``: reused if intact, else (re)generated.

    As ``coordlfs.testbed.dataset.ensure_dataset``: a directory holding anything but a dataset
    of ours is never touched, and one left half-written is remade. JPEG sizes are known only
    once encoded, so the complete manifest lists them.
    """
    spec.check()
    root = Path(root)
    manifest = read_manifest(root)
    files = _listed(manifest, spec)
    if files is not None and intact(root, files):
        return Dataset(root, spec, tuple(files), reused=True)
    written = rewrite(root, manifest, _manifest(spec, None),
                      ((rel, render(spec, rel)) for rel in spec.names()))
    write_manifest(root, _manifest(spec, written))
    return Dataset(root, spec, tuple(written), reused=False)


# -- the pipeline ----------------------------------------------------------------------------

def crop_box(width: int, height: int, scale: tuple[float, float] = SCALE,
             ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop choice, as ``(left, top, right, bottom)``: a box of a
    random share of the area and aspect ratio (log-uniform) at a random place; after ten
    misses the whole image, cut to the nearest allowed ratio, centred."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * random.uniform(*scale)
        aspect = math.exp(random.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = random.randint(0, width - w), random.randint(0, height - h)
            return left, top, left + w, top + h
    if width / height < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif width / height > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as a normalised float CHW tensor: uint8 HWC from the pixel bytes, then
    channels first, scaled to [0, 1] and normalised by the ImageNet means and deviations."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    chw = pixels.view(image.height, image.width, 3).permute(2, 0, 1).contiguous()
    return (chw.float().div_(255) - _MEAN).div_(_STD)


def read_dropping_pages(path: str, backing: str) -> bytes:
    """The file's bytes, whose pages then leave the kernel's page cache
    (``POSIX_FADV_DONTNEED``), so the next epoch reads it from the mount again, as it would
    from a dataset larger than memory: the mount's pages and the ``backing`` file's (the
    source's, which holds them where the kernel read it by passthrough; the advice on the
    mount's file does not reach it)."""
    with open(path, "rb", buffering=0) as f:
        data = f.read()
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    with open(backing, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return data


class JpegFolder(TorchDataset[tuple[torch.Tensor, int]]):
    """An ImageFolder over ``root``: class folders in name order, their ``.jpg`` files in name
    order (``samples``: (path, class index), ``files``: the paths). An item is decoded, cropped
    at random (``crop_box``) and resized to ``crop`` x ``crop``, flipped with probability 1/2
    and normalised; returns (float CHW tensor, class index)."""

    def __init__(self, root: str | os.PathLike[str], crop: int = 224,
                 drop_pages: str | None = None) -> None:
        self.root = os.fspath(root)
        self.crop = crop
        self.drop_pages = drop_pages
        self.classes = sorted(e.name for e in os.scandir(self.root)
                              if e.is_dir() and not e.name.startswith("."))
        self.samples = [(os.path.join(self.root, name, file), index)
                        for index, name in enumerate(self.classes)
                        for file in sorted(os.listdir(os.path.join(self.root, name)))
                        if file.endswith(".jpg")]
        self.files = [path for path, _label in self.samples]
        if not self.samples:
            raise UserError(f"{self.root} holds no class folders of .jpg files")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        # through the client where a coordlfs mount holds the file (a hit: no system call, no
        # copy); with drop_pages (the source beneath the mount) the POSIX path, whose pages a
        # job can drop after each file to act out a dataset larger than memory
        source = (open_binary(path) if self.drop_pages is None else io.BytesIO(
            read_dropping_pages(path, os.path.join(self.drop_pages,
                                                   os.path.relpath(path, self.root)))))
        with source, Image.open(source) as image:
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            cropped = rgb.resize((self.crop, self.crop), Image.Resampling.BILINEAR,
                                 box=crop_box(*rgb.size))
        if random.random() < 0.5:
            cropped = cropped.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_tensor(cropped), label
