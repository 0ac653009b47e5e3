"""Errors that reach a user as one line, never as a traceback."""

import sys
from collections.abc import Callable


class UserError(Exception):
    """A problem the user can fix (bad argument, missing path, mount in use).

    The CLI prints ``coordlfs: <message>`` and exits non-zero; nothing else catches it.
    """


def exit_status(prog: str, action: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a command's body: a UserError becomes ``prog: message`` and status 1, Ctrl-C 130."""
    try:
        return action()
    except UserError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
