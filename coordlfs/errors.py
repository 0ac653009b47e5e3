"""Errors that reach a user as one line, never as a traceback."""

import argparse
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
