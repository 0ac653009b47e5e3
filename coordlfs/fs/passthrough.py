"""Whether this daemon can serve files by FUSE passthrough (the kernel reads a backing file, no
READ reaches the daemon): it takes the pyfuse3 that ``scripts/setup`` patches, a kernel built
with it (Linux >= 6.9) and CAP_SYS_ADMIN, without which every backing registration is EPERM.
Checked before mounting; the mount's init (the kernel offering the capability) has the last word.
"""

from __future__ import annotations

import gzip
import os
import re
from pathlib import Path

import pyfuse3

_CAP_SYS_ADMIN = 21
_CONFIG = "CONFIG_FUSE_PASSTHROUGH"


def available() -> str | None:
    """None when passthrough can be used, else why not (one line for the log and stats)."""
    if not hasattr(pyfuse3, "backing_open"):
        return "pyfuse3 lacks backing_open (the stock build; scripts/setup builds the patched one)"
    kernel = _kernel_reason()
    if kernel:
        return kernel
    if not _has_cap(_CAP_SYS_ADMIN):
        return "the daemon lacks CAP_SYS_ADMIN (backing files need it)"
    return None


def _kernel_reason() -> str | None:
    """The kernel's build config where it is published, else its version (6.9 brought it)."""
    release = os.uname().release
    try:
        with gzip.open("/proc/config.gz", "rt") as config:
            built = any(line.startswith(f"{_CONFIG}=y") for line in config)
        return None if built else f"kernel {release} is built without {_CONFIG}"
    except OSError:
        pass
    found = re.match(r"(\d+)\.(\d+)", release)  # "6.18.0-1-amd64", "6.10-rc1"
    if found and (int(found[1]), int(found[2])) >= (6, 9):
        return None
    return f"kernel {release} lacks it (needs 6.9)"


def _has_cap(bit: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False
