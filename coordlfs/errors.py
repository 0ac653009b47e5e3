"""Errors that reach a user as one line, never as a traceback."""


class UserError(Exception):
    """A problem the user can fix (bad argument, missing path, mount in use).

    The CLI prints ``coordlfs: <message>`` and exits non-zero; nothing else catches it.
    """
