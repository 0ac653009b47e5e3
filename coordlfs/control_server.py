"""The daemon's side of the control file ``.coordlfs``.

Protocol (version 1), plain file I/O so that any language can use it:

* Reading a descriptor on which nothing was written returns the status as one JSON object.
* Writing one JSON object followed by a newline sends a request ``{"cmd": NAME, ...}``; the
  reply is one JSON line read back on the same descriptor: ``{"ok": true, ...}`` or
  ``{"ok": false, "error": MESSAGE}``. A malformed or unknown request also fails the write
  itself with EINVAL, so a shell user sees an error too. A request's ``"id"`` is echoed.

Later capabilities add commands with ``ControlServer.register``; names are ``noun`` or
``noun.verb`` (``group.join``), and replies only ever gain keys.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Longest request line accepted; a request is a small JSON object.
MAX_REQUEST = 1 << 20

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class RequestError(Exception):
    """A request the daemon refuses; the message goes back to the client."""


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class ControlServer:
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status
        self._commands: dict[str, tuple[Handler, str]] = {}
        self.register("status", lambda _req: {"status": self.status()}, "the mount's status")
        self.register("help", self._help, "the commands this mount understands")

    def register(self, name: str, handler: Handler, summary: str) -> None:
        self._commands[name] = (handler, summary)

    def _help(self, _request: dict[str, Any]) -> dict[str, Any]:
        return {"commands": {name: summary for name, (_h, summary) in self._commands.items()}}

    def handle(self, line: bytes) -> tuple[bytes, bool]:
        """Answer one request line; returns the reply line and whether the request was valid."""
        request_id = None
        try:
            try:
                request = json.loads(line)
            except ValueError as e:
                raise RequestError(f"request is not JSON: {e}") from None
            if not isinstance(request, dict):
                raise RequestError("request must be a JSON object")
            request_id = request.get("id")
            name = request.get("cmd")
            if not isinstance(name, str):
                raise RequestError('request needs "cmd", a command name')
            if name not in self._commands:
                raise RequestError(f"unknown command {name!r} (try help)")
            reply = {"ok": True, **self._commands[name][0](request)}
            ok = True
        except RequestError as e:
            reply, ok = {"ok": False, "error": str(e)}, False
        except Exception as e:  # a bug in one command must not take the mount down
            log.exception("control command failed")
            reply, ok = {"ok": False, "error": f"internal error: {e}"}, True
        if request_id is not None:
            reply["id"] = request_id
        return _encode(reply), ok


class ControlHandle:
    """One open descriptor on the control file: a request buffer and the text to read back."""

    def __init__(self, server: ControlServer) -> None:
        self._server = server
        self._pending = b""
        self._out: bytes | None = None

    def write(self, data: bytes) -> bool:
        """Take written bytes; returns False if a complete request in them was invalid."""
        self._pending += data
        ok = True
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            if line.strip():
                self._out, valid = self._server.handle(line)
                ok = ok and valid
        if len(self._pending) > MAX_REQUEST:
            self._pending = b""
            self._out = _encode({"ok": False, "error": "request line too long"})
            ok = False
        return ok

    def read(self, size: int) -> bytes:
        if self._out is None:
            self._out = _encode(self._server.status())
        chunk, self._out = self._out[:size], self._out[size:]
        return chunk


_KINDS = {int: "an integer", str: "a string", list: "a list", bool: "true or false",
          dict: "an object", float: "a number"}


def require(request: dict[str, Any], name: str, kind: type, optional: bool = False) -> Any:
    """A request argument of the given JSON type, or a RequestError naming what is wrong."""
    value = request.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise RequestError(f'"{name}" must be {_KINDS.get(kind, kind.__name__)}')
    return value
