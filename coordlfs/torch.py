"""Public path of the PyTorch side, in ``coordlfs.client.torch``."""

from coordlfs.client.torch import (
    AlignedSampler,
    SharedPrepLoader,
    pil_loader,
    profiled,
    raw_loader,
)

__all__ = ["AlignedSampler", "SharedPrepLoader", "pil_loader", "profiled", "raw_loader"]
