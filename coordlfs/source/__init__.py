"""The dataset beneath the mount: its root opened ``O_PATH``, every walk of it ``beneath`` that
root (``openat2``, no symlink or mount crossed), file versions, the reader of its bytes (no page
cache filled twice), the inotify watching of its directories, and the worker threads that block
on it.

May import: ``coordlfs.system`` and the base.
"""
