"""Starting and stopping mounts from the command line: checks, the daemon process, unmount."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shutil
import stat
import subprocess
import sys
from typing import TextIO

from coordlfs.daemon.config import MountConfig
from coordlfs.errors import UserError
from coordlfs.system.mounts import mount_at, within
from coordlfs.system.processes import holders, wait_exit

#: Seconds ``umount`` waits for the daemon to exit after the kernel let go of the mount.
EXIT_WAIT = 30.0


def set_read_ahead(mountpoint: str, kb: int) -> None:
    """Set the kernel read-ahead of a FUSE mount (its bdi), which is also its read size.

    FUSE's default of 128 KiB splits a sequential read into 128 KiB requests, each a round
    trip to a one-threaded daemon. Only valid once the daemon answered FUSE_INIT, which
    resets the value: a stat of the mountpoint returns only after that handshake. Blocking.
    """
    os.stat(mountpoint)
    entry = mount_at(mountpoint)
    if entry is None:
        raise UserError(f"{mountpoint} is not mounted")
    with open(f"/sys/class/bdi/{entry.device}/read_ahead_kb", "w") as f:
        f.write(f"{kb}\n")


def check_directory(path: str, role: str) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{role} {path} does not exist") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise _dead_mount(role, path) from None
        raise UserError(f"{role} {path}: {e.strerror}") from None
    if not os.path.isdir(path) or not (st.st_mode & 0o040000):
        raise UserError(f"{role} {path} is not a directory")
    return os.path.realpath(path)


def _dead_mount(role: str, path: str) -> UserError:
    return UserError(f"{role} {path} is a dead FUSE mount (its daemon exited); "
                     f"run: coordlfs umount {path}")


def check_mountpoint_free(mountpoint: str) -> None:
    entry = mount_at(mountpoint)
    if entry is not None and entry.fstype.startswith("fuse"):
        try:
            os.statvfs(mountpoint)  # statfs always reaches the daemon, if there is one
        except OSError as e:
            if e.errno == errno.ENOTCONN:
                raise _dead_mount("mountpoint", mountpoint) from None
        raise UserError(f"mountpoint {mountpoint} is in use: {entry.fstype} from {entry.source} "
                        "is mounted there")


def check_mountpoint_outside(mountpoint: str, source: str) -> None:
    """A mountpoint inside the source (real paths both) puts the mount beneath itself: a walk
    of its daemon's into that directory would wait on the daemon, and a reader would find the
    mount in itself. Over the source itself is fine: the daemon reaches the source through a
    descriptor opened before the mount hides it."""
    if mountpoint != source and within(mountpoint, source):
        raise UserError(f"mountpoint {mountpoint} is inside the source {source}: the mount "
                        "would hold itself; mount it outside the source, or over the source "
                        "itself")


def warn_if_not_empty(mountpoint: str, source: str) -> None:
    """The mount hides what its mountpoint holds while it is up: said, not refused (as sshfs
    and rclone do). Not over the source itself, which the mount serves."""
    if mountpoint == source:
        return
    with contextlib.suppress(OSError), os.scandir(mountpoint) as entries:
        if next(entries, None) is not None:
            print(f"coordlfs: warning: mountpoint {mountpoint} is not empty: the mount hides "
                  "what it holds", file=sys.stderr)


def open_log(path: str) -> TextIO:
    """The log file, to append to, its directory made. One this user cannot write (the
    default is under HOME, which may be missing or not this user's) is a one-line error:
    falling back to a shared directory such as /tmp would let another user plant the file,
    and to no log would hide why a detached daemon failed. Since the daemon (root, often)
    appends to it, it is never opened through a link, and a file that is not this user's
    alone (another user's, or a second name of some other file) is refused: a name in a
    directory others can write must not make the daemon write where they choose."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        raise UserError(f"cannot write the log file {path}: {e.strerror}; give --log FILE "
                        "(or --foreground, which logs to stderr)") from None
    st = os.fstat(fd)
    why = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
           else f"is owned by uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid()
           else f"has {st.st_nlink} names" if st.st_nlink != 1 else None)
    if why is not None:
        os.close(fd)
        raise UserError(f"cannot use the log file {path}: it {why}; give --log FILE")
    return open(fd, "a")


def free_space(directory: str) -> int:
    """Bytes free on the filesystem that holds (or will hold) ``directory``."""
    path = directory
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def usable_room(free: int) -> int:
    """The cache capacity that ``free`` bytes on the cache's filesystem allow: the journal,
    the pages entries share at their ends and the filesystem's other users need the rest."""
    return max(0, free - max(4 << 20, free // 50))


def spawn_daemon(config: MountConfig) -> str:
    """Start the daemon (``coordlfs.daemon.detached``) in the background; return its ready message.

    The config goes to it as JSON on its stdin: exactly the values resolved (and printed)
    here, with no second parse. It reports on a pipe once the mount is live, or why it
    failed, so that ``coordlfs mount`` returns only when the mount can be used and reports
    every failure.
    """
    log_file = config.log_file or ""
    with open_log(log_file) as log:
        read_end, write_end = os.pipe()
        child = subprocess.Popen(
            # source and mountpoint are there for ps(1) only: which daemon serves which mount
            [sys.executable, "-m", "coordlfs.daemon.detached", str(write_end), config.source,
             config.mountpoint],
            stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(write_end,),
            start_new_session=True)
    os.close(write_end)
    assert child.stdin is not None
    with contextlib.suppress(BrokenPipeError), child.stdin:  # if it died, it says so below
        child.stdin.write(config.to_json().encode())
    with os.fdopen(read_end, "rb") as pipe:
        message = b""
        while not message.endswith(b"\n"):
            select.select([pipe], [], [], 1.0)
            chunk = os.read(pipe.fileno(), 4096)
            if not chunk:
                break
            message += chunk
    text = message.decode(errors="replace").strip()
    if text.startswith("ok"):
        return text[2:].strip()
    if text.startswith("error"):
        raise UserError(text[5:].strip())
    code = child.wait()
    raise UserError(f"the daemon exited (status {code}) before the mount was ready; "
                    f"see {log_file}")


def unmount(mountpoint: str, pid: int | None, lazy: bool) -> None:
    """Unmount and wait for the daemon (if its pid is known) to exit."""
    entry = mount_at(mountpoint)
    owner = entry.owner if entry is not None else None
    if owner is not None and os.getuid() not in (0, owner):  # fusermount would say "not found"
        raise UserError(f"permission denied: {mountpoint} is mounted by uid {owner}; only that "
                        "user and root may unmount it")
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise UserError("fusermount3 not found (install the fuse3 package)")
    result = subprocess.run([tool, "-u", *(["-z"] if lazy else []), mountpoint],
                            capture_output=True, text=True)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
        if "busy" in reason.lower():
            raise UserError(f"{mountpoint} is busy: {_held_by(mountpoint, pid)}; close them, "
                            "or use --lazy")
        raise UserError(f"cannot unmount {mountpoint}: {reason}")
    if pid is not None and not wait_exit(pid, EXIT_WAIT):
        raise UserError(f"unmounted {mountpoint}, but daemon {pid} has not exited after "
                        f"{EXIT_WAIT:.0f}s")


def _held_by(mountpoint: str, daemon: int | None) -> str:
    """Who keeps a mount busy, for its refused unmount: each process with how it holds it,
    or, where /proc shows none (another user's, seen by root only), what holds it."""
    found = holders(mountpoint, exclude=(os.getpid(), *(() if daemon is None else (daemon,))))
    if not found:
        return "files or directories on it are open"
    return "held by " + ", ".join(f"pid {pid} ({command}, {how})"
                                  for pid, command, how in found)
