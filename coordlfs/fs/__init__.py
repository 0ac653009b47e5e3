"""The filesystem the kernel sees: pyfuse3's ``Operations``, inodes, listings, the kernel's view
kept fresh, the open files (``opens``: how each is served, decided once), the readers their
bytes come from (cache, peer, source), the backing files passthrough serves them by, and the
control file's engine (``control_server``), which answers every domain's commands.

May import: ``coordlfs.peers``, ``coordlfs.jobs``, ``coordlfs.cache``, ``coordlfs.protocol``,
``coordlfs.source``, ``coordlfs.system`` and the base.
"""
