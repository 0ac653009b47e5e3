"""Partitioned caching across nodes: who caches which file (``placement``), the wire protocol, the
links to the other nodes, the server of this node's cache to them, the holding area of files
fetched ahead (``hold``), each node's share of a warm (``warm``), and where the list of nodes
comes from (``sources``).

May import: ``coordlfs.cache``, ``coordlfs.protocol`` (declarations), ``coordlfs.source``,
``coordlfs.system`` and the base; never the jobs, the filesystem or the daemon.
"""
