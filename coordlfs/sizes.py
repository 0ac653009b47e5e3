"""Byte sizes as users write them (``40G``, ``512M``, ``1073741824`` or ``50%`` of RAM), and
sizes and counts as users read them (``format_size``, ``plural``): every command's output
writes a number with its unit or noun through here, so "1 file" and "2 files" never drift."""

import os
import re

from coordlfs.errors import UserError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def pages(size: int) -> int:
    """What ``size`` bytes occupy on tmpfs, as the cache charges them: whole pages."""
    page = os.sysconf("SC_PAGE_SIZE")
    return -(-size // page) * page


def physical_memory() -> int:
    """Bytes of RAM on this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_size(text: str, what: str = "size") -> int:
    """Parse ``text`` into bytes; K/M/G/T are powers of 1024, ``N%`` is a share of RAM.

    Raises UserError with a one-line message for anything else (negative, empty, junk).
    """
    match = _PERCENT_RE.match(text)
    if match:
        percent = float(match.group(1))
        if percent > 100:
            raise UserError(f"bad {what} {text!r}: a percentage of memory must be at most 100%")
        return int(physical_memory() * percent / 100)
    match = _SIZE_RE.match(text)
    if not match:
        raise UserError(
            f"bad {what} {text!r}: expected bytes with an optional K/M/G/T suffix "
            "(powers of 1024) or a percentage of memory such as 50%"
        )
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def format_size(n: float) -> str:
    """Short human form with binary units, for tables and messages."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


#: "ch" said as "k" takes a plain "s": the spelling cannot tell it from "batch"
_HARD_CH = ("epoch",)


def plural(n: int, noun: str) -> str:
    """``n`` with ``noun`` in the number it takes: "1 file", "0 files", "2 batches", "3
    misses", "2 entries", "2 epochs" (the regular English plurals: every noun our output
    counts has one)."""
    if n == 1:
        return f"{n} {noun}"
    if noun.endswith(("s", "sh", "ch", "x", "z")) and not noun.endswith(_HARD_CH):
        return f"{n} {noun}es"
    if noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u"):
        return f"{n} {noun[:-1]}ies"
    return f"{n} {noun}s"
