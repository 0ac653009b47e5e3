"""The no-eviction cache: whole files kept in memory once read and never evicted (entries,
the compact tables and the journal a restart keeps), the index it publishes to clients in
shared memory, the fills that read ahead in the order jobs announced, the cache's own tmpfs,
and the read counters every reader of bytes adds to (``stats``).

May import: ``coordlfs.protocol`` (declarations), ``coordlfs.source``, ``coordlfs.system`` and
the base. ``published`` is stdlib-only: the job side reads the index with it.
"""
