"""The filesystem the kernel sees: pyfuse3's ``Operations``, inodes, listings, the kernel's view
kept fresh, and the readers that pick where a file's bytes come from (cache, peer, source);
the control file's engine, which answers every domain's commands, is
``coordlfs.protocol.server``.

May import: ``coordlfs.peers``, ``coordlfs.jobs``, ``coordlfs.cache``, ``coordlfs.protocol``,
``coordlfs.source``, ``coordlfs.system`` and the base.
"""
