"""What the operating system gives: the mount table, other processes by pid, directories of our own
that nobody else may change.

Its one job is to read and make those things safely; it knows nothing of coordlfs's caches,
peers or jobs. May import: the base only (``coordlfs.errors``, ``coordlfs.sizes`` and the
package's constants in ``coordlfs``), as every wing may; every wing above may import this one.
"""
