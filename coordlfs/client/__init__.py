"""The job side: what a training job imports; stdlib-only unless it asks for a framework.

``Dataset`` reads cached files from the cache's shared memory and the rest through the mount or
from the source; ``adapters`` find the mount holding a path and hand it an order;
``shared_prep`` shares pre-processed batches (``batch_file``) between jobs; ``warm``
(``warm_files``, ``warm_progress``) is ``coordlfs warm``, whose bar on a terminal is tqdm's.
The frameworks' adapters: ``torch`` (imports torch), ``fsspec_fs`` (the ``coordlfs://``
protocol) and ``webdataset``; users (and fsspec's entry point) name them by their paths at
the top of the package, ``coordlfs.torch``, ``coordlfs.fsspec_fs`` and
``coordlfs.webdataset``, which re-export them. The Python client of the control file is
``coordlfs.protocol.client`` (``coordlfs.control``).

May import: ``coordlfs.cache`` (the published index), ``coordlfs.protocol`` (declarations),
``coordlfs.source``, ``coordlfs.system`` and the base; never the daemon's wings (``fs``,
``peers``, ``jobs``, ``daemon``), which need trio.
"""

from coordlfs.client.dataset import Dataset

__all__ = ["Dataset"]
