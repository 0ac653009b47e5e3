"""The job side: what a training job imports; stdlib-only unless it asks for a framework.

``Dataset`` reads cached files from the cache's shared memory and the rest through the mount or
from the source; ``adapters`` find the mount holding a path and hand it an order;
``shared_prep`` shares pre-processed batches (``batch_file``) between jobs; ``warm``
(``warm_files``, ``warm_progress``) is ``coordlfs warm``, whose bar on a terminal is tqdm's.
The modules users (and fsspec's entry point) name by path stay at the top of the package
and belong to this wing: ``coordlfs.control`` (the Python client of the control file),
``coordlfs.torch``, ``coordlfs.fsspec_fs`` (the ``coordlfs://`` protocol) and
``coordlfs.webdataset``.

May import: ``coordlfs.cache`` (the published index), ``coordlfs.protocol`` (declarations),
``coordlfs.source``, ``coordlfs.system`` and the base; never the daemon's wings (``fs``,
``peers``, ``jobs``, ``daemon``), which need trio.
"""

from coordlfs.client.dataset import Dataset

__all__ = ["Dataset"]
