"""Every control-file command, declared once: name, who may run it, arguments, what it does.

The daemon validates a request's arguments from its command's declaration before the handler
sees them and answers ``help`` from it; the client (``client``) sends commands by their
declaration, so a misspelt command or argument fails in the caller, not at the mount;
the table in docs/design/control-protocol.md is ``doc_table()`` (a test compares them).
Handlers live with what they act on (``coordlfs.cache.stats``, ``groups``, ``prep``,
``peer_server``) and are attached by name (``ControlServer.serve``).
"""

from __future__ import annotations

import enum
import errno
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from coordlfs import CONTROL_NAME
from coordlfs.protocol.order import SEED_LIMIT
from coordlfs.system.processes import process_uids

#: Longest group or job name, characters.
MAX_NAME = 128
#: The longest a request may wait for its answer (``"timeout_s"``), seconds: a waiting
#: request holds one of the daemon's FUSE workers, and an unmount waits for it.
MAX_WAIT_S = 5.0
#: The least time a prep member may go without a request mid-epoch, seconds, unless its
#: group asks for another (``prep.join``'s ``hang_timeout_s``).
DEFAULT_HANG_FLOOR_S = 30.0


class RequestError(Exception):
    """A request the daemon refuses; the message goes back to the client (EINVAL)."""

    errno = errno.EINVAL


class Refused(RequestError):
    """A request the caller may not make (another user's process or membership, or a
    mount-wide command from a user other than root or the mount's owner)."""

    errno = errno.EACCES


class Access(enum.Enum):
    """Who may run a command."""

    #: anyone who can see the mount: the command reports state and changes nothing
    READ = "anyone"
    #: anyone, for their own processes and memberships (the handler checks the caller)
    OWN = "anyone, for their own processes and memberships"
    #: root and the mount's owner only: the command changes the mount for everyone
    MOUNT = "root or the mount's owner"
    #: anyone, for files they may read through the mount (the handler checks each file)
    FILES = "anyone, for files they may read through the mount"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: the process that opened the control descriptor.

    FUSE tells the daemon the uid and pid of the process behind each open; a descriptor
    handed to another process keeps its opener's rights, as any open file does.
    """

    uid: int
    pid: int
    #: root or the mount's owner (the daemon's uid): may run mount-wide commands and act on
    #: any membership
    privileged: bool

    def act_for(self, pid: int) -> None:
        """Refuse ``pid`` unless it runs as the caller's uid (root may name any process). A
        process that is gone passes: the command says "no process" itself."""
        if self.uid == 0:
            return
        uids = process_uids(pid)
        if uids is not None and self.uid not in uids:
            raise Refused(f"process {pid} belongs to another user: a request may name only "
                          "the caller's own processes")

    def use(self, owner: int, what: str) -> None:
        """Refuse acting on ``what``, created by uid ``owner``, unless the caller created it
        (root and the mount's owner may act on any)."""
        if owner != self.uid and not self.privileged:
            raise Refused(f"{what} belongs to another user")


#: A command's handler: the request's checked arguments (``Command.validate``) and its caller.
Handler = Callable[[dict[str, Any], Caller], dict[str, Any]]


class Served(Protocol):
    """Where a domain attaches its commands' handlers (``register_commands``): the control
    file's server (``coordlfs.protocol.server``) as a domain sees it, so that a domain
    imports only these declarations."""

    def serve(self, name: str, handler: Handler) -> None: ...

    def notify(self) -> None: ...


# -- argument kinds: each turns a request's JSON value into the handler's, or says what is wrong


class Kind(Protocol):
    def parse(self, name: str, value: Any, caller: Caller, /) -> Any: ...


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f'"{name}" must be an integer')
    return value


@dataclass(frozen=True)
class Integer:
    """An integer in [low, high)."""

    low: int | None = None
    high: int | None = None
    #: what to say when it is out of range (``{name}`` is the argument's)
    message: str = '"{name}" is out of range'

    def parse(self, name: str, value: Any, _caller: Caller) -> int:
        value = _integer(name, value)
        if ((self.low is not None and value < self.low)
                or (self.high is not None and value >= self.high)):
            raise RequestError(self.message.format(name=name))
        return value


COUNT = Integer(0, None, '"{name}" must not be negative')
POSITIVE = Integer(1, 1 << 40, '"{name}" must be a positive integer')


@dataclass(frozen=True)
class Seconds:
    """A number of seconds in [low, high] (a JSON integer or float)."""

    low: float
    high: float
    message: str

    def parse(self, name: str, value: Any, _caller: Caller) -> float:
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not self.low <= value <= self.high):
            raise RequestError(self.message.format(name=name))
        return float(value)


class Text:
    def parse(self, name: str, value: Any, _caller: Caller) -> str:
        if not isinstance(value, str):
            raise RequestError(f'"{name}" must be a string')
        return value


class Name(Text):
    """A group's or a job's name: short and printable."""

    def parse(self, name: str, value: Any, caller: Caller) -> str:
        value = super().parse(name, value, caller)
        if not 0 < len(value) <= MAX_NAME or not value.isprintable():
            raise RequestError(f'"{name}" must be 1 to {MAX_NAME} printable characters')
        return value


class Flag:
    def parse(self, name: str, value: Any, _caller: Caller) -> bool:
        if not isinstance(value, bool):
            raise RequestError(f'"{name}" must be true or false')
        return value


class Pid:
    """A process of the caller's (root may name any)."""

    def parse(self, name: str, value: Any, caller: Caller) -> int:
        value = _integer(name, value)
        if value <= 0:
            raise RequestError(f'"{name}" must be a process id')
        caller.act_for(value)
        return value


def _relative(path: Any) -> bool:
    return isinstance(path, str) and bool(path) and not path.startswith("/") and "\0" not in path


class RelativePath(Text):
    def parse(self, name: str, value: Any, caller: Caller) -> str:
        value = super().parse(name, value, caller)
        if not _relative(value):
            raise RequestError(f'"{name}" must be a path relative to the mount')
        return value


class RelativePaths:
    def parse(self, name: str, value: Any, _caller: Caller) -> list[str]:
        if not isinstance(value, list):
            raise RequestError(f'"{name}" must be a list')
        if not all(_relative(p) for p in value):
            raise RequestError(f'"{name}" must be paths relative to the mount')
        return value


#: Most paths one ``prefetch`` request may name: a longer order is sent in several requests.
MAX_PREFETCH_PATHS = 1 << 16
#: Longest path ``prefetch`` takes, bytes: it is opened in one system call (PATH_MAX).
MAX_PREFETCH_PATH = 4095


def _file_path(path: Any) -> bool:
    """A relative path a reader could open: no empty, ``.`` or ``..`` part, short enough for
    one system call, and bytes a file name can hold (JSON may carry lone surrogates); not the
    control file, which hides any source file of its name."""
    if (not _relative(path) or path == CONTROL_NAME
            or any(part in ("", ".", "..") for part in path.split("/"))):
        return False
    try:
        return len(path.encode("utf-8", "surrogateescape")) <= MAX_PREFETCH_PATH
    except UnicodeEncodeError:
        return False


class FilePaths:
    """Paths of files to read, relative to the mount, spelt as a reader would open them: a
    path names a file in the tree the mount shows and never climbs out of it."""

    def parse(self, name: str, value: Any, _caller: Caller) -> list[str]:
        if not isinstance(value, list):
            raise RequestError(f'"{name}" must be a list')
        if len(value) > MAX_PREFETCH_PATHS:
            raise RequestError(f'"{name}" may hold at most {MAX_PREFETCH_PATHS} paths per '
                               "request (send a longer order in several)")
        for path in value:
            if not _file_path(path):
                raise RequestError(f'"{name}": {path!r} is not a path of a file relative to '
                                   "the mount (no leading /, no empty, . or .. parts)")
        return value


class Batches:
    def parse(self, name: str, value: Any, _caller: Caller) -> list[int]:
        if not isinstance(value, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) for b in value):
            raise RequestError(f'"{name}" must be a list of batch numbers')
        return value


@dataclass(frozen=True)
class Arg:
    name: str
    kind: Kind
    optional: bool = False
    #: an optional argument's value when the request has none (or null)
    default: Any = None

    def doc(self) -> str:
        return f'"{self.name}"' + ("?" if self.optional else "")


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    #: mount-wide unless said otherwise, so that a new command is safe
    access: Access = Access.MOUNT
    args: tuple[Arg, ...] = ()
    #: what a successful reply holds beside ``ok`` (for help and the docs)
    reply: str = ""
    #: a command that may wait for its answer: whether a reply is final. Such a command takes
    #: ``"timeout_s"``: when its answer is not final yet, the mount answers once it is, or
    #: once ``timeout_s`` passed (then with the not-final answer); the reader blocks meanwhile.
    ready: Callable[[dict[str, Any]], bool] | None = None

    def validate(self, request: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """The request's arguments, checked and with defaults, in declaration order (which
        is the order they are checked in)."""
        values = {}
        for arg in self.args:
            value = request.get(arg.name)
            if value is None and arg.optional:
                values[arg.name] = arg.default
            else:
                values[arg.name] = arg.kind.parse(arg.name, value, caller)
        return values

    def help(self) -> str:
        text = f"{self.summary}; replies {self.reply}" if self.reply else self.summary
        return text + ('; waits up to "timeout_s" for a final answer' if self.ready else "")


WAIT = Arg("timeout_s", Seconds(0, MAX_WAIT_S,
                                f'"{{name}}" must be seconds from 0 to {MAX_WAIT_S:g}'),
           optional=True, default=0.0)
MEMBER = Arg("member", Integer())
GROUP = Arg("group", Name())
JOB = Arg("job", Name(), optional=True)
PID = Arg("pid", Pid())
BATCH = Arg("batch", COUNT)

_READS = Integer(0, 1 << 60, '"{name}" must be a count of reads or bytes')
CLIENT_REPORT = Command(
    "client.report", "add a coordlfs.client's reads since its last report to the counters",
    Access.OWN, (*(Arg(name, _READS) for name in ("hits", "misses", "bytes_from_cache",
                                                   "bytes_from_mount")),
                 # later than the rest: optional, so that an older client's report still adds
                 *(Arg(name, _READS, optional=True, default=0)
                   for name in ("direct", "bytes_direct"))))

STATUS = Command("status", "the mount's status", Access.READ, reply='"status"')
SHARE = Command(
    "share", "the caller's clients read cached files themselves: the index of them is kept from "
    "now on (nothing writes it until a client asks), with the entries cached before", Access.OWN,
    (WAIT,), '"status" (as "status" gives it), "backlog" (entries cached before, still to '
    'publish)', ready=lambda reply: not reply.get("backlog"))
HELP = Command("help", "the commands this mount understands", Access.READ,
               reply='"commands", "access", "arguments"')
STATS = Command("stats", "the read counters between two marks (default: mount time and now)",
                Access.READ, (Arg("since", Text(), optional=True),
                              Arg("until", Text(), optional=True)),
                '"stats" {"since", "until", "seconds", "reads"}')
MARK = Command("mark", "record the counters at a named point, such as an epoch boundary",
               Access.MOUNT, (Arg("name", Text()),), '"mark"')
MARKS = Command("marks", "every mark with the counters at that point", Access.READ,
                reply='"marks"')

GROUP_JOIN = Command(
    "group.join", "join (or create) an aligned group for a live process of the caller's",
    Access.OWN, (PID, GROUP, JOB, Arg("seed", Integer(0, SEED_LIMIT,
                                                      '"{name}" must be in [0, 2**64)'),
                                      optional=True)),
    '"group", "seed" (the first member\'s, else random), "member", "members"')
GROUP_LEAVE = Command("group.leave", "leave an aligned group", Access.OWN, (MEMBER,))
GROUP_FILES = Command(
    "group.files", "register the dataset's files in index order, in chunks (the first "
    "complete list wins)", Access.OWN,
    (MEMBER, Arg("offset", COUNT), Arg("total", COUNT), Arg("paths", RelativePaths())),
    '"files", "complete"')
GROUP_EPOCH = Command("group.epoch", "a member starts an epoch", Access.OWN,
                      (MEMBER, Arg("epoch", COUNT)))
GROUP_LIST = Command("group.list", "aligned groups, their members and step profiles",
                     Access.READ, reply='"groups", "profiles"')
_SECONDS = Seconds(0, math.nextafter(1e9, 0), '"{name}" must be a number of seconds >= 0')
PROFILE = Command(
    "profile", "add a job's step profile for an epoch", Access.OWN,
    (Arg("job", Name()), PID, Arg("epoch", COUNT), Arg("steps", COUNT),
     Arg("wait_s", _SECONDS), Arg("step_s", _SECONDS)),
    '"profile" (the epoch\'s totals and "partners": the jobs that shared a group with it)')

PEER_LIST = Command("peer.list", "the peers, their health and counters, and what this node "
                    "served", Access.READ, reply='"peers", "served"')
PEER_OWNER = Command("peer.owner", "the node that caches a file", Access.READ,
                     (Arg("path", RelativePath()),), '"owner", "here"')

PREFETCH = Command(
    "prefetch", "queue files to be read into the cache in this order, many at once (after "
    "the caller's earlier ones; up to a bound in all); with 'warm', only those this node "
    "caches, and the caller's progress is kept for warm.status", Access.FILES,
    (Arg("paths", FilePaths()),
     # what the files come to, where the caller knows: the room clients see leaves it to them
     Arg("bytes", Integer(0, 1 << 60, '"{name}" must be a count of bytes'), optional=True,
         default=0),
     Arg("warm", Flag(), optional=True, default=False)),
    '"queued" (how many were taken); with "warm", "elsewhere" (the places in "paths" of '
    'those a peer caches, left to it)')

#: What a warm's files came to so far, on one node (``warm.status``; the peer wire carries
#: them in this order): files filled and their bytes; already cached; no room left in the
#: cache; over --max-file-size; left to a peer; not a regular file; failed; still to do.
WARM_COUNTS = ("files", "bytes", "cached", "cached_bytes", "no_room", "no_room_bytes",
               "too_large", "elsewhere", "not_regular", "failed", "left")
WARM_STATUS = Command(
    "warm.status", "how far the caller's warm (prefetch with 'warm') has come, here and "
    "on the peers it asked (warm.peers)", Access.OWN, (WAIT,),
    ready=lambda reply: not (reply["here"] or {}).get("left"),
    reply='"here" (' + ", ".join(f'"{c}"' for c in WARM_COUNTS) + '; null before any), '
          '"peers" (per address the same and "unsent", or "error")')
WARM_CANCEL = Command(
    "warm.cancel", "drop the files of the caller's warm still queued, here and on the peers "
    "it asked", Access.OWN, reply='"dropped"')
WARM_PEERS = Command(
    "warm.peers", "ask every peer to warm its share of these files, after the caller's "
    "earlier ones (up to a bound: send the rest once they took these)", Access.MOUNT,
    (Arg("paths", FilePaths()),), '"queued" (how many were taken)')

CACHED = Command(
    "cached", "which of these files the cache holds whole, in the version the source has now; "
    "fills nothing", Access.FILES, (Arg("paths", FilePaths()),),
    '"cached" (the places in "paths" of those it holds)')

PREP_JOIN = Command(
    "prep.join", "join (or create) a prep group for a live process of the caller's",
    Access.OWN,
    (PID, Arg("samples", POSITIVE), Arg("batch_size", POSITIVE),
     Arg("drop_last", Flag(), optional=True, default=False),
     Arg("min_members", Integer(1, 1025, '"{name}" must be an integer from 1 to 1024'),
         optional=True, default=1),
     Arg("hang_timeout_s", Seconds(0.1, 86400, '"{name}" must be seconds from 0.1 to 86400'),
         optional=True, default=DEFAULT_HANG_FLOOR_S),
     JOB, GROUP),
    '"member", "group", "seed", "batches", "members", "staging_capacity_bytes", '
    '"staging_share_bytes"')
PREP_EPOCH = Command(
    "prep.epoch", "ask for the member's next epoch", Access.OWN, (MEMBER, WAIT),
    '"epoch", "batches", "members" once it runs, else "wait"',
    ready=lambda reply: "epoch" in reply)
PREP_CLAIM = Command(
    "prep.claim", "take the lowest batch nobody prepares yet", Access.OWN, (MEMBER, WAIT),
    '"batch" (null when none is left, with "outstanding": claims other members still hold)',
    ready=lambda reply: reply.get("batch") is not None or not reply.get("outstanding"))
PREP_RESERVE = Command(
    "prep.reserve", "room in the staging area for a claimed batch", Access.OWN,
    (MEMBER, BATCH, Arg("bytes", Integer(1, None, '"{name}" must be positive')), WAIT),
    '"path" to write it to, or "full" (retry once batches were published or used)',
    ready=lambda reply: not reply.get("full"))
PREP_PUBLISH = Command("prep.publish", "a claimed batch is written: every member may use it",
                       Access.OWN, (MEMBER, BATCH), '"bytes"')
PREP_NEXT = Command(
    "prep.next", "acknowledge used batches and take the next", Access.OWN,
    (MEMBER, Arg("done", Batches(), optional=True, default=[]), WAIT),
    '"batch", "path", "bytes", "producer"; or "wait"; or "end"',
    ready=lambda reply: not reply.get("wait"))
PREP_LEAVE = Command("prep.leave", "leave a prep group", Access.OWN, (MEMBER,))
PREP_LIST = Command("prep.list", "prep groups, their members and the staging area",
                    Access.READ, reply='"staging", "groups"')

#: Every command, by name, in the order of the docs' table.
COMMANDS: dict[str, Command] = {c.name: c for c in (
    STATUS, SHARE, HELP, STATS, MARK, MARKS, CLIENT_REPORT,
    GROUP_JOIN, GROUP_LEAVE, GROUP_FILES, GROUP_EPOCH, GROUP_LIST, PROFILE,
    PEER_LIST, PEER_OWNER, PREFETCH, WARM_STATUS, WARM_CANCEL, WARM_PEERS, CACHED,
    PREP_JOIN, PREP_EPOCH, PREP_CLAIM, PREP_RESERVE, PREP_PUBLISH, PREP_NEXT, PREP_LEAVE,
    PREP_LIST)}

_ACCESS_WORDS = {Access.READ: "anyone", Access.OWN: "own", Access.MOUNT: "owner",
                 Access.FILES: "reader"}


def doc_table() -> str:
    """The command table of docs/design/control-protocol.md."""
    rows = ["| Command | Arguments | Who | What it does; reply |", "|---|---|---|---|"]
    for command in COMMANDS.values():
        args = ", ".join(a.doc() for a in command.args) or "-"
        rows.append(f"| `{command.name}` | {args} | {_ACCESS_WORDS[command.access]} | "
                    f"{command.help()} |")
    return "\n".join(rows) + "\n"
