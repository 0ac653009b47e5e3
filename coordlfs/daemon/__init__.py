"""The mount as a process: its options and configuration, mounting and unmounting, the detached
daemon's entry (``python -m coordlfs.daemon.detached``), the assembly of every wing into one
running mount (``daemon``), and its Prometheus metrics.

May import every product wing but ``coordlfs.client`` and ``coordlfs.models``: ``coordlfs.fs``,
``coordlfs.peers``, ``coordlfs.jobs``, ``coordlfs.cache``, ``coordlfs.protocol``,
``coordlfs.source``, ``coordlfs.system`` and the base.
"""
