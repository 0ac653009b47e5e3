"""Python client for a mount's control file (its server: ``coordlfs.protocol.server``).

    from coordlfs.control import Control
    ctl = Control("/mnt/data")
    ctl.mark("epoch-1")
    print(ctl.stats(since="epoch-1")["reads"]["bytes_from_source"])

Commands are sent by their declaration in ``coordlfs.protocol.spec`` (``call``), so a misspelt
command or argument fails here; ``request`` sends any command by name, for a mount newer than
this client.
"""

from __future__ import annotations

import errno
import json
import os
import time
import warnings
from typing import Any

from coordlfs import CONTROL_NAME
from coordlfs.errors import UserError
from coordlfs.protocol import spec as control_spec
from coordlfs.protocol.spec import Command
from coordlfs.system.mounts import mount_at, mount_holding

#: Paths per ``group.files`` request, well under the 1 MiB request limit for long paths.
FILES_PER_REQUEST = 2000
#: How long a command that may wait (``Command.ready``) waits at the mount for its final
#: answer, seconds, before the caller gets the answer so far and may ask again.
WAIT_S = 1.0
#: The pause after a not-final answer the mount gave at once (too many requests wait
#: already, or a mount from before waiting), so that asking again does not spin.
BACKOFF_S = 0.02
#: A write failing with one of these was answered: the reply says why (malformed, refused).
_ANSWERED = (errno.EINVAL, errno.EACCES, errno.EPERM)


class ControlError(UserError):
    """The mount refused a request, or the path is no coordlfs mount."""


class MountDenied(ControlError, PermissionError):
    """This user may not reach the path: a ControlError for the CLI and for callers that
    degrade without the mount, a PermissionError (EACCES, the path) for the rest."""

    def __str__(self) -> str:
        return str(self.strerror)


def denied(path: str) -> MountDenied:
    """A MountDenied for ``path`` that names the directory barring the way: a coordlfs
    mount of another user (without ``--allow-other`` the kernel lets no one else in), or a
    directory this user may not enter."""
    real = os.path.realpath(path)
    parts = real.strip("/").split("/")
    on_the_way = ["/" + "/".join(parts[:n]) for n in range(len(parts) + 1)]
    closed = next((d for d in on_the_way if not os.access(d, os.X_OK)), None)
    entry = mount_at(closed) if closed else None
    if entry is not None and entry.fstype == "fuse.coordlfs" and "allow_other" not in entry.options:
        why = f" ({closed} is a coordlfs mount of uid {entry.owner}, without --allow-other)"
    else:
        why = f" (this user may not enter {closed})" if closed else ""
    return MountDenied(errno.EACCES, f"permission denied: {path}{why}", path)


class Control:
    def __init__(self, mountpoint: str | os.PathLike[str]) -> None:
        self.mountpoint = os.fspath(mountpoint)
        self.path = os.path.join(self.mountpoint, CONTROL_NAME)

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags)
        except FileNotFoundError:
            raise ControlError(f"{self.mountpoint} is not a coordlfs mount") from None
        except PermissionError:
            raise denied(self.mountpoint) from None
        except OSError as e:
            raise ControlError(f"{self.mountpoint}: {e.strerror}") from None

    def status(self) -> dict[str, Any]:
        fd = self._open(os.O_RDONLY)
        try:
            return json.loads(_read_all(fd))
        finally:
            os.close(fd)

    def share(self, timeout_s: float = WAIT_S) -> dict[str, Any]:
        """The mount's status for a client that reads cached files itself: the mount keeps
        its index of them from now on (``share``; waits up to ``timeout_s`` for the entries
        cached before to be in it). Where no request can be sent (a mount bound read-only
        into a container refuses the control file's read-write open; an older mount lacks
        the command), the status as a read gives it: the client reads through the mount
        what the index does not hold."""
        try:
            return self.call(control_spec.SHARE, timeout_s=timeout_s)["status"]
        except ControlError:
            return self.status()

    def request(self, cmd: str, **args: Any) -> dict[str, Any]:
        """Send one command and return its reply; ControlError carries the mount's message."""
        line = json.dumps({"cmd": cmd, **args}).encode() + b"\n"
        fd = self._open(os.O_RDWR)
        try:
            try:
                os.write(fd, line)
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    raise ControlError(f"{self.mountpoint}: the control file holds too many "
                                       "bytes for open descriptors; retry later") from None
                if e.errno not in _ANSWERED:
                    raise ControlError(f"{self.mountpoint}: {e.strerror}") from None
            reply = json.loads(_read_all(fd))
        finally:
            os.close(fd)
        if not reply.get("ok"):
            raise ControlError(reply.get("error", "request failed"))
        return reply

    def call(self, command: Command, **args: Any) -> dict[str, Any]:
        """Send ``command`` with ``args``, its declared arguments (a required one missing or
        one it does not take is a ValueError: a bug in the caller, not the mount's to say).

        A command that may wait blocks until its answer is final or ``WAIT_S`` passed,
        unless ``args`` say how long (``timeout_s=0``: answer at once)."""
        declared = {a.name for a in command.args}
        missing = {a.name for a in command.args if not a.optional} - args.keys()
        if args.keys() - declared or missing:
            raise ValueError(f"{command.name} takes {sorted(declared)}, not {sorted(args)}")
        if command.ready is None or "timeout_s" in args:
            return self.request(command.name, **args)
        start = time.monotonic()
        reply = self.request(command.name, timeout_s=WAIT_S, **args)
        if not command.ready(reply) and time.monotonic() - start < WAIT_S / 2:
            time.sleep(BACKOFF_S)
        return reply

    def stats(self, since: str | None = None, until: str | None = None) -> dict[str, Any]:
        return self.call(control_spec.STATS, since=since, until=until)["stats"]

    def mark(self, name: str) -> dict[str, Any]:
        return self.call(control_spec.MARK, name=name)["mark"]

    def marks(self) -> list[dict[str, Any]]:
        return self.call(control_spec.MARKS)["marks"]

    def join_group(self, group: str, job: str | None = None, seed: int | None = None,
                   pid: int | None = None) -> dict[str, Any]:
        """Join (or create) an aligned group; the reply has its ``seed`` and our ``member`` id."""
        return self.call(control_spec.GROUP_JOIN, group=group, job=job, seed=seed,
                         pid=os.getpid() if pid is None else pid)

    def leave_group(self, member: int) -> None:
        self.call(control_spec.GROUP_LEAVE, member=member)

    def register_files(self, member: int, paths: list[str]) -> bool:
        """Tell the group the dataset's files (relative to the mount) in index order, so the
        mount can read ahead; returns whether the group now knows the whole list."""
        reply: dict[str, Any] = {"complete": not paths}
        for start in range(0, len(paths), FILES_PER_REQUEST):
            reply = self.call(control_spec.GROUP_FILES, member=member, offset=start,
                              total=len(paths), paths=paths[start:start + FILES_PER_REQUEST])
            if reply["complete"]:
                break  # another member registered the list first
        return bool(reply["complete"])

    def start_epoch(self, member: int, epoch: int) -> None:
        self.call(control_spec.GROUP_EPOCH, member=member, epoch=epoch)

    def report_profile(self, job: str, epoch: int, steps: int, wait_s: float, step_s: float,
                       pid: int | None = None) -> dict[str, Any]:
        return self.call(control_spec.PROFILE, job=job, epoch=epoch, steps=steps, wait_s=wait_s,
                         step_s=step_s, pid=os.getpid() if pid is None else pid)["profile"]


def find_mount(path: str | os.PathLike[str]) -> str | None:
    """The coordlfs mount that holds ``path``, or None; a path this user may not reach is a
    MountDenied, not None: it may well be on a mount, only not this user's to read."""
    real = os.path.realpath(path)
    try:
        os.stat(real)
    except PermissionError:
        raise denied(os.fspath(path)) from None
    except OSError:
        pass  # not there: on the mount that holds its directory, if any
    entry = mount_holding(real)
    return entry.mountpoint if entry is not None and entry.fstype == "fuse.coordlfs" else None


def control_for(path: str | os.PathLike[str] | None, what: str) -> Control | None:
    """The control file of the mount holding ``path``; without one, a warning that says the
    job goes on ``what`` without the mount (the caller degrades, never fails)."""
    if path is None:
        warnings.warn(f"coordlfs: no path given, {what} without the mount", stacklevel=3)
        return None
    try:
        mount = find_mount(path)
    except MountDenied as e:
        warnings.warn(f"coordlfs: {e}; {what} without the mount", stacklevel=3)
        return None
    if mount is None:
        warnings.warn(f"coordlfs: {path} is not on a coordlfs mount; {what} without it",
                      stacklevel=3)
        return None
    return Control(mount)


def dataset_root(data_source: Any) -> str | None:
    """Where a torchvision-style dataset lives (``ImageFolder.root``), if it says."""
    root = getattr(data_source, "root", None)
    return os.fspath(root) if isinstance(root, str | os.PathLike) else None


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)
