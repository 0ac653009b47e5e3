"""The filesystem the kernel sees: pyfuse3's ``Operations``, inodes, listings, the kernel's view
kept fresh, the readers that pick where a file's bytes come from (cache, peer, source), and the
control file's engine (``control_server``), which answers every domain's commands.

May import: ``coordlfs.peers``, ``coordlfs.jobs``, ``coordlfs.cache``, ``coordlfs.protocol``,
``coordlfs.source``, ``coordlfs.system`` and the base.
"""
