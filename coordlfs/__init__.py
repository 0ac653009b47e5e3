"""coordlfs: a FUSE caching filesystem that removes data stalls from deep-learning training."""

__version__ = "0.1.0"

#: Name of the control entry at the mount root (hidden from listings, reachable by name).
CONTROL_NAME = ".coordlfs"

#: Version of the control-file protocol; bumped when a reply changes incompatibly.
PROTOCOL_VERSION = 1
