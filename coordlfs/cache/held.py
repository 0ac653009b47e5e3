"""Which files the cache holds: the ``cached`` command, for ``coordlfs warm --check``.

A file is held when the cache has a complete entry for the version the source has now (the
cache's own ``lookup``: the rule an open goes by), so a check says what the next epoch will
find, and fills nothing. Asked on the control file rather than read from the published index
(``coordlfs.cache.published``), which only users who may enter the cache directory can map
and which a mount whose index could not be made has not: the daemon answers every user, for
the files that user may read, as ``prefetch`` does. One lstat per file, on the event loop,
as ``prefetch``'s check of who may read: callers send a few thousand paths a request.
"""

from __future__ import annotations

import os
from typing import Any

from coordlfs.cache.cache import WholeFileCache
from coordlfs.cache.fills import Credentials, readable
from coordlfs.protocol.spec import Caller, Served
from coordlfs.source.source import Source


def held(cache: WholeFileCache, source: Source, path: bytes) -> bool:
    """Whether ``path`` (relative to the source) is a complete entry of its current version."""
    try:
        st = source.lstat(path)
    except (OSError, ValueError):
        return False
    entry = cache.lookup((st.st_dev, st.st_ino), st)
    return entry is not None and entry.complete


def register_commands(server: Served, cache: WholeFileCache, source: Source) -> None:
    """``cached``: anyone, for the files they may read through the mount (a request naming
    one they may not is refused whole: what is cached would tell of files they cannot see)."""

    def cached(args: dict[str, Any], caller: Caller) -> dict[str, Any]:
        paths = [os.fsencode(p) for p in args["paths"]]
        if not caller.privileged:
            readable(source, Credentials.of(caller), paths)
        return {"cached": [i for i, path in enumerate(paths) if held(cache, source, path)]}

    server.serve("cached", cached)
