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

from coordlfs.errors import UserError

_CAP_SYS_ADMIN = 21
_CONFIG = "CONFIG_FUSE_PASSTHROUGH"


def available() -> str | None:
    """None when passthrough can be used, else why not (one line for the log and stats)."""
    if not hasattr(pyfuse3, "backing_open"):
        return "pyfuse3 lacks backing_open (the stock build; scripts/setup builds the patched one)"
    if not hasattr(pyfuse3, "passthrough_wanted"):
        return "pyfuse3 is an older patched build (scripts/setup rebuilds it)"
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


def chosen(mode: str) -> str | None:
    """Settle ``--passthrough`` (yes, no, auto) before mounting: None to ask the kernel for
    it at init, else why not. Tells pyfuse3 whether to ask: a mount that asks bars stacking
    on it (the kernel's stack depth), so ``no`` does not even ask. ``yes`` that cannot be
    had is a one-line UserError."""
    why = "off (--passthrough no)" if mode == "no" else available()
    if why is not None and mode == "yes":
        raise UserError(f"--passthrough yes: {why}")
    if hasattr(pyfuse3, "passthrough_wanted"):
        pyfuse3.passthrough_wanted = why is None
    return why


def granted() -> str | None:
    """After the kernel's init: None if passthrough was asked for and granted, else why not."""
    if getattr(pyfuse3, "passthrough_granted", False):
        return None
    return "the kernel did not offer it at init"
