"""The daemon's side of the control file ``.coordlfs``.

Protocol (version 1), plain file I/O so that any language can use it:

* Reading a descriptor on which nothing was written returns the status as one JSON object.
* Writing one JSON object followed by a newline sends a request ``{"cmd": NAME, ...}``; the
  reply is one JSON line read back on the same descriptor: ``{"ok": true, ...}`` or
  ``{"ok": false, "error": MESSAGE}``. Several requests on one descriptor (in one write or
  many) are answered in order, their replies queued back to back. A malformed or unknown
  request also fails the write itself with EINVAL, a refused one with EACCES, so a shell user
  sees an error too. A request's ``"id"`` is echoed.

Commands are declared in ``coordlfs.protocol.spec``; the server checks a request's arguments
from the declaration and hands the handler their values. Handlers are synchronous and quick;
a command declared with ``ready`` may instead wait for its answer (``"timeout_s"``): a write
never blocks, the read does, until the answer is final (every change of the daemon's state
asks it again) or the time is up (``Waiting``, ``ControlServer.settle``).

Who may do what (the mount may be shared with ``--allow-other``): the caller is the uid that
opened the descriptor. Every command is declared with an ``Access``: anyone may run a READ
command (they report, change nothing); an OWN command acts only for the caller's own processes
and on memberships the caller created (``Caller.act_for`` checks a pid argument, handlers check
memberships with ``Caller.use``); any other command is mount-wide and needs root or the mount's
owner.

Memory: the bytes a descriptor holds (a partial request line, unread replies, a waiting
request) are bounded per descriptor and, for all descriptors together, by ``MAX_HELD``; a write
past the bound fails with ENOBUFS and nothing of it is kept. Waiting requests are bounded per
user and in all (``MAX_WAITING``); past the bound a request is answered at once.

Later capabilities declare commands in ``coordlfs.protocol.spec`` and attach their handlers
with ``ControlServer.serve``; names are ``noun`` or ``noun.verb`` (``group.join``), and replies
only ever gain keys.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from coordlfs.protocol.spec import COMMANDS, Access, Caller, Command, Handler, Refused, RequestError

log = logging.getLogger(__name__)

#: Longest request line accepted, newline excluded; a request is a small JSON object. A longer
#: line is refused whole: nothing of it runs, up to and including its newline.
MAX_REQUEST = 1 << 20
#: Unread replies one descriptor may queue; past it its further requests are refused with
#: ENOBUFS until it reads them.
MAX_REPLIES = 1 << 20
#: Bytes all open control descriptors together may hold (partial request lines, unread replies
#: and statuses); past it a write, or a status read, fails with ENOBUFS and keeps nothing.
MAX_HELD = 16 << 20
#: Of ``MAX_HELD``, callers other than root and the mount's owner may fill only this much, so
#: the owner can still read the status and run commands while other users hold descriptors.
MAX_HELD_UNPRIVILEGED = MAX_HELD // 2
#: Deepest nesting of arrays and objects in a request; deeper is malformed.
MAX_DEPTH = 32
#: Requests that may wait for their answer at once, and of them one user's: a waiting read
#: holds one of pyfuse3's FUSE workers (99 at most), which the file system's own requests
#: need. Past either bound a request is answered at once, final or not.
MAX_WAITING = 32
MAX_WAITING_PER_USER = 16


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _too_deep(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest deeper than ``limit`` (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse(line: bytes) -> dict[str, Any]:
    """One request line as a JSON object, or a RequestError naming what is wrong."""
    try:
        request = json.loads(line)
    except RecursionError:
        raise RequestError(f"request nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise RequestError(f"request is not JSON: {e}") from None
    # Brackets bound the depth: only a request with many of them needs the walk.
    if line.count(b"[") + line.count(b"{") > MAX_DEPTH and _too_deep(request, MAX_DEPTH):
        raise RequestError(f"request nests deeper than {MAX_DEPTH} levels")
    if not isinstance(request, dict):
        raise RequestError("request must be a JSON object")
    return request


@dataclass(slots=True)
class Waiting:
    """A request whose answer is not final yet (``Command.ready``): it is asked again on every
    change of the daemon's state until it is, or until its deadline."""

    command: Command
    handler: Handler
    args: dict[str, Any]
    caller: Caller
    request_id: Any
    #: ``time.monotonic()`` when it is answered, final or not
    deadline: float
    #: bytes held for it (its request line)
    size: int
    done: bool = False


class ControlServer:
    def __init__(self, status: Callable[[], dict[str, Any]],
                 owner_uid: int | None = None) -> None:
        self.status = status
        #: the mount's owner: the uid the daemon runs as
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        #: bytes held by every open ControlHandle together
        self.held = 0
        #: waiting requests, by the uid that sent them
        self.waiting: Counter[int] = Counter()
        self._commands: dict[str, tuple[Command, Handler]] = {}
        #: set when the state changes, for the waiting requests (made by the first of them)
        self._change: trio.Event | None = None
        #: the mount is going: no request waits
        self.closing = False
        self.serve("status", lambda _a, _c: {"status": self.snapshot()})
        self.serve("help", self._help)

    def serve(self, name: str, handler: Handler) -> None:
        """Answer the command declared as ``name`` in ``coordlfs.protocol.spec``."""
        self.add(COMMANDS[name], handler)

    def add(self, command: Command, handler: Handler) -> None:
        self._commands[command.name] = (command, handler)

    def caller(self, uid: int, pid: int) -> Caller:
        return Caller(uid, pid, privileged=uid in (0, self.owner_uid))

    def snapshot(self) -> dict[str, Any]:
        """The status, with what the control file itself holds."""
        return {**self.status(), "control": {"held_bytes": self.held,
                                             "limit_bytes": MAX_HELD,
                                             "waiting": self.waiting.total()}}

    def _help(self, _args: dict[str, Any], _caller: Caller) -> dict[str, Any]:
        commands = [command for command, _handler in self._commands.values()]
        return {"commands": {c.name: c.help() for c in commands},
                "access": {c.name: c.access.value for c in commands},
                "arguments": {c.name: [a.doc() for a in c.args] for c in commands}}

    def notify(self) -> None:
        """The daemon's state changed: waiting requests ask again."""
        if self._change is not None:
            self._change.set()
            self._change = None

    def close(self) -> None:
        """The mount is going: waiting requests are answered now (not final), and none
        waits any more, so that the FUSE loop ends at once."""
        self.closing = True
        self.notify()

    def handle(self, line: bytes, caller: Caller | None = None) -> tuple[bytes, int]:
        """Answer one request line for ``caller`` (None: the mount's owner, as an in-process
        caller is); returns the reply line and the errno the write fails with (0: none)."""
        reply, error, _waiting = self.answer(line, caller, may_wait=False)
        return reply, error

    def answer(self, line: bytes, caller: Caller | None,
               may_wait: bool) -> tuple[bytes, int, Waiting | None]:
        """``handle``; a request that may wait (``may_wait``, a ``"timeout_s"``, room among
        the waiting) and whose answer is not final comes back as a ``Waiting`` instead."""
        caller = caller or self.caller(self.owner_uid, os.getpid())
        request_id = None
        try:
            request = parse(line)
            request_id = request.get("id")
            command, handler = self._command(request.get("cmd"), caller)
            args = command.validate(request, caller)
        except RequestError as e:
            return _encode(_with_id({"ok": False, "error": str(e)}, request_id)), e.errno, None
        reply, error = self._call(command, handler, args, caller, again=False)
        if (may_wait and not error and command.ready is not None and not command.ready(reply)
                and args.get("timeout_s") and self._room_to_wait(caller.uid)):
            self.waiting[caller.uid] += 1
            return b"", 0, Waiting(command, handler, args, caller, request_id,
                                   time.monotonic() + args["timeout_s"], len(line))
        return _encode(_with_id(reply, request_id)), error, None

    def _command(self, name: Any, caller: Caller) -> tuple[Command, Handler]:
        if not isinstance(name, str):
            raise RequestError('request needs "cmd", a command name')
        if name not in self._commands:
            raise RequestError(f"unknown command {name!r} (try help)")
        command, handler = self._commands[name]
        if command.access is Access.MOUNT and not caller.privileged:
            raise Refused(f"{name} is mount-wide: only root or the mount's owner (uid "
                          f"{self.owner_uid}) may run it")
        return command, handler

    def _call(self, command: Command, handler: Handler, args: dict[str, Any], caller: Caller,
              again: bool) -> tuple[dict[str, Any], int]:
        """Run a handler; a command that changes something wakes the waiting requests,
        unless it is one of them asked ``again`` that is still not final (they would wake
        each other for ever)."""
        try:
            reply, error = {"ok": True, **handler(args, caller)}, 0
        except RequestError as e:
            return {"ok": False, "error": str(e)}, e.errno
        except Exception as e:  # a bug in one command must not take the mount down
            log.exception("control command failed")
            return {"ok": False, "error": f"internal error: {e}"}, 0
        final = command.ready is None or command.ready(reply)
        if command.access is not Access.READ and (final or not again):
            self.notify()
        return reply, error

    def _room_to_wait(self, uid: int) -> bool:
        return (not self.closing and self.waiting.total() < MAX_WAITING
                and self.waiting[uid] < MAX_WAITING_PER_USER)

    async def settle(self, waiting: Waiting) -> bytes:
        """The answer of a waiting request: asked again on every change until it is final
        or its deadline passed (then the last answer, not final)."""
        ready = waiting.command.ready
        assert ready is not None  # only a command that may wait is made to
        try:
            while True:
                if self._change is None:
                    self._change = trio.Event()
                change = self._change
                reply, error = self._call(waiting.command, waiting.handler, waiting.args,
                                          waiting.caller, again=True)
                left = waiting.deadline - time.monotonic()
                if error or left <= 0 or self.closing or ready(reply):
                    return _encode(_with_id(reply, waiting.request_id))
                with trio.move_on_after(left):
                    await change.wait()
        finally:
            self.release(waiting)

    def release(self, waiting: Waiting) -> None:
        """The request no longer waits (answered, or its descriptor closed)."""
        if not waiting.done:
            waiting.done = True
            self.waiting[waiting.caller.uid] -= 1


def _with_id(reply: dict[str, Any], request_id: Any) -> dict[str, Any]:
    if request_id is not None:
        reply["id"] = request_id
    return reply


class ControlHandle:
    """One open descriptor on the control file: its opener, the partial request line written
    so far, and the replies (or status) not yet read back.

    One request of a descriptor at a time may wait for its answer (``Waiting``): a read then
    blocks until it is answered, and replies to later requests queue behind it, so replies
    keep the requests' order. Later requests run at once; they do not wait themselves.

    Its bytes count against the server's ``held``: ``close`` gives them back.
    """

    def __init__(self, server: ControlServer, uid: int, pid: int) -> None:
        self._server = server
        self.caller = server.caller(uid, pid)
        self._pending = bytearray()
        #: the rest of an over-long line is being dropped, up to its newline
        self._discarding = False
        self._out = bytearray()
        #: a request waiting for its answer, and the replies queued behind it
        self._waiting: Waiting | None = None
        self._later = bytearray()
        self._reading = trio.Lock()
        self._written = False
        self._status_read = False
        self._held = 0

    @property
    def _limit(self) -> int:
        return MAX_HELD if self.caller.privileged else MAX_HELD_UNPRIVILEGED

    def _account(self) -> None:
        """Bring the server's count of held bytes up to date with this handle's."""
        held = (len(self._pending) + len(self._out) + len(self._later)
                + (self._waiting.size if self._waiting else 0))
        self._server.held += held - self._held
        self._held = held

    def _would_hold(self, data: bytes) -> int:
        """The partial line this handle would hold after taking ``data``."""
        newline = data.rfind(b"\n")
        if newline >= 0:
            held = len(data) - newline - 1
        else:
            held = 0 if self._discarding else len(self._pending) + len(data)
        return held if held <= MAX_REQUEST else 0  # an over-long line is dropped, not held

    def write(self, data: bytes) -> int:
        """Take written bytes and run the complete requests in them, in order; returns the
        errno the write fails with: 0, the first refused request's, or ENOBUFS (then nothing
        of ``data`` was taken).

        A line that grows past ``MAX_REQUEST`` is refused whole: its reply is queued, the
        write stops there (the rest of ``data`` is not looked at) and the descriptor drops
        what follows up to a newline in a later write, failing those writes with EINVAL too.
        So no part of it ever runs, even for a writer that sends the rest of a partial write
        again (the kernel splits a large write, and reports the pieces before a failed one as
        written).
        """
        growth = self._would_hold(data) - len(self._pending)
        if growth > 0 and self._server.held + growth > self._limit:
            return errno.ENOBUFS
        self._written = True
        error = 0
        start = 0
        while True:
            newline = data.find(b"\n", start)
            end = len(data) if newline < 0 else newline
            if self._discarding:
                error = errno.EINVAL
            elif len(self._pending) + end - start > MAX_REQUEST:
                self._refuse_long_line()
                error = errno.EINVAL
                break
            else:
                self._pending += data[start:end]
            if newline < 0:
                break
            if not self._discarding:
                answered = self._run(bytes(self._pending))
                error = error or answered
            self._pending.clear()
            self._discarding = False
            start = newline + 1
        self._account()
        return error

    def _refuse_long_line(self) -> None:
        self._pending = bytearray()
        self._discarding = True
        self._queue(_encode({"ok": False, "error": f"request line longer than {MAX_REQUEST} "
                                                   "bytes: refused whole"}))

    def _run(self, line: bytes) -> int:
        if not line.strip():
            return 0
        if (len(self._out) + len(self._later) > MAX_REPLIES
                or self._server.held >= self._limit):
            return errno.ENOBUFS  # the replies already queued must be read first
        reply, error, waiting = self._server.answer(line, self.caller,
                                                    may_wait=self._waiting is None)
        if waiting is not None:
            self._waiting = waiting
            self._account()
        else:
            self._queue(reply)
        return error

    def _queue(self, reply: bytes) -> None:
        if self._waiting is not None:
            self._later += reply
        else:
            self._out += reply
        self._account()

    async def read(self, size: int) -> bytes:
        """The next bytes of the replies; on a descriptor never written, of the status. With
        nothing else to read, a waiting request is waited for."""
        if not self._written and not self._status_read:
            status = _encode(self._server.snapshot())
            if self._server.held + len(status) > self._limit:
                raise OSError(errno.ENOBUFS, "control descriptors hold too many bytes")
            self._status_read = True
            self._queue(status)
        if not self._out and self._waiting is not None:
            async with self._reading:  # two readers of one descriptor: one waits, once
                if self._waiting is not None:
                    reply = await self._server.settle(self._waiting)
                    self._waiting = None
                    self._out += reply + self._later
                    self._later.clear()
        chunk = bytes(self._out[:size])
        del self._out[:size]
        self._account()
        return chunk

    def close(self) -> None:
        """The descriptor is closed: free what it held."""
        self._pending = bytearray()
        self._out = bytearray()
        self._later = bytearray()
        if self._waiting is not None:
            self._server.release(self._waiting)
            self._waiting = None
        self._account()
