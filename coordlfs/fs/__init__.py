"""The filesystem the kernel sees: pyfuse3's ``Operations``, inodes, listings, the kernel's view
kept fresh, the open files (``opens``: how each is served, decided once), the readers their
bytes come from (cache, peer, source) and the backing files passthrough serves them by; the
control file's engine, which answers every domain's commands, is ``coordlfs.protocol.server``.

May import: ``coordlfs.peers``, ``coordlfs.jobs``, ``coordlfs.cache``, ``coordlfs.protocol``,
``coordlfs.source``, ``coordlfs.system`` and the base.
"""
