"""Errors that reach a user as one line, never as a traceback."""

import argparse
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import NoReturn


class UserError(Exception):
    """A problem the user can fix (bad argument, missing path, mount in use).

    The CLI prints ``coordlfs: <message>`` and exits non-zero; nothing else catches it.
    """


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line that points at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def exit_status(prog: str, action: Callable[[], int], interrupted: str = "interrupted",
                sigterm_interrupts: bool = False) -> int:
    """Run a command's body: a UserError becomes ``prog: message`` and status 1, Ctrl-C 130.

    With ``sigterm_interrupts`` SIGTERM is handled as Ctrl-C, so a command that holds
    cgroups, throttles and mounts cleans them up when a scheduler or ``kill`` stops it (a
    shell starts background jobs with Ctrl-C ignored).
    """
    previous = signal.signal(signal.SIGTERM, _interrupt) if sigterm_interrupts else None
    try:
        return action()
    except UserError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def quiet_on_closed_pipe(action: Callable[[], int]) -> int:
    """Run a whole command, ending as ``cat`` and ``ls`` do when whoever reads its output
    stops reading (``coordlfs stats --json | head -1``): by SIGPIPE, silently, after the
    command's own clean-up ran (Python ignores SIGPIPE, so a write raises BrokenPipeError
    instead, which would end in a traceback). Output still buffered is flushed here, inside,
    so that a closed pipe found only at exit is caught too."""
    try:
        try:
            return action()
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        return _die_of_sigpipe()


def _die_of_sigpipe() -> int:
    """End by SIGPIPE (a shell reports 141); 141 should the signal not end us at once (it
    may reach another of our threads a moment later). stdout is pointed at /dev/null first:
    the interpreter's last flush must find nothing to write to the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    return 128 + signal.SIGPIPE
