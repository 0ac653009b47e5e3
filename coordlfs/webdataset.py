"""Public path of webdataset's ``coordlfs`` scheme, in ``coordlfs.client.webdataset``."""

from coordlfs.client.webdataset import SCHEME, open_url, register

__all__ = ["SCHEME", "open_url", "register"]
