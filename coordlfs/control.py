"""Public path of the control file's Python client, in ``coordlfs.protocol.client``."""

from coordlfs.protocol.client import (
    BACKOFF_S,
    FILES_PER_REQUEST,
    WAIT_S,
    Control,
    ControlError,
    MountDenied,
    control_for,
    dataset_root,
    denied,
    find_mount,
)

__all__ = ["BACKOFF_S", "FILES_PER_REQUEST", "WAIT_S", "Control", "ControlError", "MountDenied",
           "control_for", "dataset_root", "denied", "find_mount"]
