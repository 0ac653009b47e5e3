"""``coordlfs://`` URLs for webdataset: each shard read through the client of its mount.

    import webdataset as wds
    import coordlfs.webdataset
    coordlfs.webdataset.register()
    data = wds.WebDataset("coordlfs:///mnt/data/shards/train-{000000..000099}.tar",
                          shardshuffle=100)

webdataset opens URLs with its own opener (``webdataset.gopen``), not with fsspec, and knows
a scheme only from its table ``gopen_schemes``: without ``register`` a ``coordlfs://`` URL
fails with "no gopen handler defined". Register at the top level of the script, so that
DataLoader workers started by spawn or forkserver, which import it again, have it too. A
plain path on the mount (``/mnt/data/shards/...``) needs none of this: webdataset opens it
with ``open``, through the kernel, and the mount caches it all the same.
"""

from __future__ import annotations

import errno
from typing import IO, Any

from coordlfs.client.adapters import open_binary

SCHEME = "coordlfs"


def open_url(url: str, mode: str = "rb", bufsize: int = -1, **_kw: Any) -> IO[bytes]:
    """webdataset's handler for ``coordlfs:///absolute/path``: read-only, as the mount is."""
    path = url.removeprefix(f"{SCHEME}://")
    if not path.startswith("/"):
        raise ValueError(f"{url}: a {SCHEME} URL names an absolute path, "
                         f"{SCHEME}:///mnt/data/...")
    if mode != "rb":
        raise OSError(errno.EROFS, "coordlfs: the mount is read-only", path)
    return open_binary(path)


def register() -> None:
    """Add ``coordlfs`` to webdataset's table of URL schemes (again: no harm)."""
    from webdataset.gopen import gopen_schemes

    gopen_schemes[SCHEME] = open_url
