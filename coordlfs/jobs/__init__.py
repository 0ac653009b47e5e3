"""What the mount knows of the jobs reading it: memberships of live processes, aligned groups with
their seed and epochs, the read window and the read-ahead it feeds, and prep-sharing's books.
The models of jobs worked out offline (stagger, what-if) are ``coordlfs.models``.

May import: ``coordlfs.cache``, ``coordlfs.protocol`` (declarations), ``coordlfs.source``,
``coordlfs.system`` and the base; never the peers, the filesystem or the daemon.
"""
