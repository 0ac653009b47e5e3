"""Public path and fsspec entry point of ``coordlfs://``, in ``coordlfs.client.fsspec_fs``."""

from coordlfs.client.fsspec_fs import CoordlfsFileSystem

__all__ = ["CoordlfsFileSystem"]
