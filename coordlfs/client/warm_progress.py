"""How ``coordlfs warm`` shows its progress: a bar on a terminal (tqdm: files, bytes, rate and
time left), a plain line every ``LINE_S`` otherwise (a log, a pipe, a batch job's output), or
nothing (``--json``, whose summary is the only output on stdout)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Protocol

from coordlfs.sizes import format_size, plural

#: Seconds between two plain progress lines.
LINE_S = 1.0


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a warm has come on this node: files and bytes done of the total."""

    files: int
    total_files: int
    bytes: int
    total_bytes: int


class Display(Protocol):
    #: the progress last put before the user's eyes (None: none yet), which a message about
    #: the warm's end repeats, so that the two never disagree
    shown: Progress | None

    def found(self, files: int, size: int) -> None:
        """The walk found ``files`` so far, of ``size`` bytes in all."""

    def show(self, progress: Progress) -> None: ...

    def close(self) -> None: ...


def _found(files: int, size: int) -> str:
    return f"warm: walking, {plural(files, 'file')} ({format_size(size)}) found"


class Bar:
    """A count while walking, on one line rewritten; then a tqdm bar of bytes, with the files
    done beside it, drawn from the first progress on, once the total is known."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._bar: Any = None
        self._counted = False
        self.shown: Progress | None = None

    def found(self, files: int, size: int) -> None:
        self._counted = True
        self.stream.write(f"\r\x1b[K{_found(files, size)}")
        self.stream.flush()

    def _start(self, total: int, files: str) -> Any:
        from tqdm import tqdm  # only a terminal needs it

        try:
            sized = all(os.get_terminal_size(self.stream.fileno()))
        except OSError:
            sized = False
        # a terminal that says it has no size (a bare pseudo-terminal) gets one: tqdm would
        # draw nothing in none
        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="warm",
                    file=self.stream, dynamic_ncols=sized, ncols=None if sized else 80,
                    nrows=None if sized else 24, mininterval=0.2, postfix=files,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B"
                               "{postfix} [{elapsed}<{remaining}, {rate_fmt}]")

    def show(self, progress: Progress) -> None:
        files = f"{progress.files}/{plural(progress.total_files, 'file')}"
        if self._bar is None:
            if self._counted:  # the count's line stays, the bar comes below it
                self.stream.write("\n")
            self._bar = self._start(progress.total_bytes, files)
        self._bar.total = progress.total_bytes
        self._bar.set_postfix_str(files, refresh=False)
        self._bar.update(progress.bytes - self._bar.n)
        self.shown = progress

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._counted:  # stopped while walking: what follows starts a line of its own
            self.stream.write("\n")
            self.stream.flush()


class Lines:
    """A plain line now and then: ``warm: 120/500 files, 12.0M/50.0M, 8.0M/s, 5 s left``."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.start = time.monotonic()
        self._next = self.start + LINE_S
        self.shown: Progress | None = None

    def _due(self) -> bool:
        """Whether a line is due (one every ``LINE_S``)."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + LINE_S
        return True

    def found(self, files: int, size: int) -> None:
        self.start = time.monotonic()  # the rate is of the reading, which starts after
        if self._due():
            print(_found(files, size), file=self.stream, flush=True)

    def show(self, progress: Progress) -> None:
        if not self._due():
            return
        self.shown = progress
        now = time.monotonic()
        rate = progress.bytes / max(now - self.start, 1e-9)
        left = ((progress.total_bytes - progress.bytes) / rate if rate else None)
        print(f"warm: {progress.files}/{plural(progress.total_files, 'file')}, "
              f"{format_size(progress.bytes)}/{format_size(progress.total_bytes)}, "
              f"{format_size(int(rate))}/s, "
              f"{'?' if left is None else f'{left:.0f}'} s left", file=self.stream,
              flush=True)

    def close(self) -> None:
        pass


class Quiet:
    """Nothing while it runs; what it came to is the message's alone."""

    def __init__(self) -> None:
        self.shown: Progress | None = None

    def found(self, files: int, size: int) -> None:
        pass

    def show(self, progress: Progress) -> None:
        self.shown = progress

    def close(self) -> None:
        pass


def display(json_summary: bool) -> Display:
    """A bar where a person watches (stdout a terminal; with ``--json``, stderr), plain lines
    on stdout when it is not a terminal, nothing beside a JSON summary off a terminal."""
    if json_summary:
        return Bar(sys.stderr) if sys.stderr.isatty() else Quiet()
    return Bar(sys.stdout) if sys.stdout.isatty() else Lines(sys.stdout)


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary for a person: what was read, what was there, what did not fit, per node."""
    lines = [_node_line("warmed", summary)]
    fit = summary["did_not_fit"]
    if fit["files"]:
        lines.append(f"cache full: {plural(fit['files'], 'file')} ({format_size(fit['bytes'])}) "
                     "did not fit")
    if summary["too_large"]:
        lines.append(f"{plural(summary['too_large'], 'file')} over the mount's "
                     "--max-file-size, not cached")
    if summary["failed"]:
        lines.append(f"{plural(summary['failed'], 'file')} failed (the mount's log says why)")
    for address, node in summary["nodes"].items():
        lines.append(f"node {address}: {node['error']}" if "error" in node
                     else _node_line(f"node {address}:", node))
    return lines


def _node_line(what: str, counts: dict[str, Any]) -> str:
    seconds = counts.get("seconds")
    timing = (f" in {seconds:.1f} s ({format_size(int(counts['bytes_per_s']))}/s)"
              if seconds is not None else "")
    cached = counts["already_cached"]
    line = (f"{what} {plural(counts['files'], 'file')} ({format_size(counts['bytes'])}) read "
            f"into the cache{timing}, {cached['files']} ({format_size(cached['bytes'])}) "
            "already there")
    fit = counts["did_not_fit"]
    if fit["files"] and what != "warmed":
        line += f", {fit['files']} ({format_size(fit['bytes'])}) did not fit"
    if counts.get("elsewhere"):
        line += f"; {counts['elsewhere']} left to the nodes that cache them"
    return line


def check_line(held: dict[str, Any]) -> str:
    """``warm --check``'s answer for a person: how much of what was named the cache holds."""
    percent = "-" if held["percent"] is None else f"{held['percent']:.1f}%"
    return (f"cached: {held['cached_files']} of {plural(held['files'], 'file')}, "
            f"{format_size(held['cached_bytes'])} of {format_size(held['bytes'])} ({percent} "
            f"of the bytes) in the cache of {held['mount']}")
