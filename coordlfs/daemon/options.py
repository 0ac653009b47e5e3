"""The options of ``coordlfs mount``, declared once.

Each ``Option`` says how the option is spelled (``--cache-size`` on the command line,
``cache_size`` in ``-o``, fstab and the mount(8) helper), how its text is parsed and
range-checked, its default, its help and the ``MountConfig`` field it sets. From the table
come the argparse arguments, the parsing of ``-o``, the ``MountConfig`` the daemon runs with,
and the README's option table (tests/unit/test_options.py holds one against the other), so
that a new option is one entry here.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from coordlfs.daemon.config import (
    DEFAULT_FILL_DEPTH,
    DEFAULT_MAX_FILE_SHARE,
    DEFAULT_PEER_TIMEOUT,
    DEFAULT_PREFETCH_DEPTH,
    DEFAULT_REVALIDATE,
    DEFAULT_STAGING_SIZE,
    DEFAULT_WINDOW_SIZE,
    MountConfig,
    default_cache_dir,
    default_cache_size,
    default_log_file,
)
from coordlfs.daemon.mounting import free_space, usable_room
from coordlfs.errors import UserError
from coordlfs.peers.budget import DEFAULT_LIMIT as DEFAULT_PEER_CONNECTIONS
from coordlfs.peers.placement import find_self, is_loopback, parse_address, parse_peers, read_secret
from coordlfs.sizes import format_size, parse_size
from coordlfs.system.mounts import within

#: Options mount(8), fstab and systemd pass to every filesystem: accepted in ``-o`` and
#: ignored (the mount is read-only and its own process anyway). ``x-*`` too.
GENERIC = frozenset({
    "rw", "ro", "defaults", "auto", "noauto", "user", "nouser", "users", "_netdev", "nofail",
    "exec", "noexec", "suid", "nosuid", "dev", "nodev", "async", "atime", "noatime",
    "relatime", "strictatime", "nodiratime", "comment",
})

#: The values resolved so far, by option name (plus ``source`` and ``mountpoint``).
Values = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Option:
    #: the name in ``-o``; the flag is the same with dashes
    name: str
    help: str
    #: turns the text into the value, or raises a one-line UserError naming ``flag``;
    #: None for a switch (present or not)
    parse: Callable[[str, str], Any] | None = None
    metavar: str = ""
    #: the value when not given, or a function of the values of the options it depends on
    default: Any = None
    #: the default as help and the README state it, where it is not the value itself
    default_text: str = ""
    #: applied to the value, given or default: a rule that needs other options' values
    settle: Callable[[Any, Values], Any] | None = None
    short: str = ""
    #: the ``MountConfig`` field it sets, when not ``name``; None for how the command runs
    field: str | None = ""
    #: ``--help`` lists options under these headings
    section: str = "cache and source"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def in_mount_options(self) -> bool:
        """``-o`` (fstab, mount(8)) can give it: everything but how the command itself runs."""
        return self.field is not None

    @property
    def mount_option(self) -> str:
        """The spelling in ``-o``: ``cache_size=SIZE``, a switch bare."""
        if self.parse is None:
            return self.name
        return f"{self.name}={self.metavar.replace(',', '+')}"

    def stated_default(self) -> str:
        """The default in words, for help and the README; '' when there is none to state."""
        if self.default_text or callable(self.default) or self.parse is None:
            return self.default_text
        if self.default is None or self.default == ():
            return ""
        if self.metavar == "SIZE":
            return _short_size(self.default)
        return f"{self.default:g}"


def _short_size(n: int) -> str:
    """``256M`` for 256 MiB: the spelling a user would write."""
    for shift, unit in ((40, "T"), (30, "G"), (20, "M"), (10, "K")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


#: The smallest cache (0 aside: off): one page, the unit its memory comes in; a smaller one
#: could hold no page of any file, and such a size is a slip (1K for 1G) more than a wish.
MIN_CACHE_SIZE = mmap.PAGESIZE
#: Below this a cache holds less than one read brings in (the cache fills files in 1 MiB
#: chunks and the kernel reads the mount in 1 MiB requests: ``cache.FILL_CHUNK``,
#: ``daemon.READ_AHEAD_KB``): it works, for small files, but is warned about.
SMALL_CACHE_SIZE = 1 << 20


def _cache_size(text: str, flag: str) -> int:
    size = parse_size(text, flag)
    if 0 < size < MIN_CACHE_SIZE:
        raise UserError(f"bad {flag} {text}: at least {_short_size(MIN_CACHE_SIZE)}, one page "
                        "(or 0: no cache, every read from the source)")
    return size


def _size_above_zero(text: str, flag: str) -> int:
    size = parse_size(text, flag)
    if size <= 0:
        raise UserError(f"bad {flag} {text}: must be more than 0")
    return size


def _number(kind: type, low: float, high: float, *, low_open: bool = False,
            unit: str = "") -> Callable[[str, str], Any]:
    """A parser of ``kind`` numbers from ``low`` (exclusive with ``low_open``) to ``high``."""
    if low_open:
        span = f"more than {low:g}, at most {high:g}{unit}"
    else:
        span = f"{low:g} to {high:g}{unit}"

    def parse(text: str, flag: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise UserError(f"bad {flag} {text!r}: expected a number, {span}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise UserError(f"bad {flag} {text}: {span}")
        return value
    return parse


def _path(text: str, flag: str) -> str:
    if not text:
        raise UserError(f"{flag} needs a path")
    return os.path.abspath(text)


def _address(text: str, flag: str) -> str:
    return str(parse_address(text, flag))


def _peers(text: str, flag: str) -> tuple[str, ...]:
    # '+' as well as ',': commas separate mount options, so fstab and -o join peers with '+'
    return tuple(str(p) for p in parse_peers(text.replace("+", ",")))


def _peers_from(text: str, flag: str) -> str:
    """``slurm`` or ``dns:NAME:PORT``: the form only; ``coordlfs.peers.sources`` resolves it."""
    kind, _, rest = text.partition(":")
    if text == "slurm":
        return text
    name, _, port = rest.rpartition(":")
    if kind != "dns" or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"bad {flag} {text!r}: slurm or dns:NAME:PORT")
    return text


def _fit_free_space(cache_size: int, values: Values) -> int:
    """A new cache directory gets no more than its filesystem has free, less a margin; a
    cache of 0 is said out loud, since every read then goes to the source."""
    if cache_size == 0:
        print("coordlfs: warning: --cache-size 0: no cache, every read goes to the source",
              file=sys.stderr)
        return 0
    if cache_size < SMALL_CACHE_SIZE:
        print(f"coordlfs: warning: --cache-size {format_size(cache_size)} holds less than one "
              f"read ({_short_size(SMALL_CACHE_SIZE)}): only smaller files are cached",
              file=sys.stderr)
    cache_dir = values["cache_dir"]
    room = usable_room(free_space(cache_dir))
    if cache_size > room and not os.path.isdir(cache_dir):
        if room < MIN_CACHE_SIZE:
            raise UserError(f"only {format_size(room)} free for {cache_dir} (less a margin), "
                            f"less than the smallest cache ({_short_size(MIN_CACHE_SIZE)}); "
                            "give --cache-dir on a filesystem with room")
        print(f"coordlfs: warning: --cache-size {format_size(cache_size)} is more than the "
              f"{format_size(room)} free for {cache_dir} (less a margin); using "
              f"{format_size(room)}", file=sys.stderr)
        return room
    return cache_size


def _within_cache(max_file_size: int, values: Values) -> int:
    """A file larger than the cache can never be cached: such a limit is lowered to the
    cache's size (which the status then shows), with a warning."""
    cache_size = values["cache_size"]
    if max_file_size <= cache_size:
        return max_file_size
    if cache_size:  # with no cache at all, --cache-size 0 has said so
        print(f"coordlfs: warning: --max-file-size {format_size(max_file_size)} is more than "
              f"the cache ({format_size(cache_size)}): files above the cache size can never be "
              f"cached; using {format_size(cache_size)}", file=sys.stderr)
    return cache_size


def _yes_no_auto(text: str, flag: str) -> str:
    if text not in ("yes", "no", "auto"):
        raise UserError(f"bad {flag} {text!r}: yes, no or auto")
    return text


def _settle_cache_tmpfs(value: str, values: Values) -> bool:
    """auto: root, with the cache in its default directory (a directory the user named is
    used as it is)."""
    if value == "auto":
        return os.geteuid() == 0 and values["cache_dir"] == default_cache_dir(values["source"])
    return value == "yes"


def _default_log(values: Values) -> str | None:
    return None if values["foreground"] else default_log_file(values["mountpoint"])


CLUSTER = "partitioned caching: misses served from the peers' memory"
GROUPS = "aligned jobs and prep-sharing"
RUN = "the mount"

#: Every option of ``coordlfs mount``, in the order of ``--help`` and the README's table.
OPTIONS: tuple[Option, ...] = (
    Option("cache_size", "cache capacity: bytes with a K/M/G/T suffix (powers of 1024) or N% "
           "of RAM; never more than the cache directory's free space; at least 4K (0: no "
           "cache)", _cache_size, "SIZE", default=lambda values: default_cache_size(),
           default_text="50% of RAM", settle=_fit_free_space),
    Option("max_file_size", "larger files are read from the source, never cached; at "
           "most the cache size", parse_size, "SIZE",
           default=lambda values: int(values["cache_size"] * DEFAULT_MAX_FILE_SHARE),
           default_text="a quarter of the cache", settle=_within_cache),
    Option("cache_dir", "where cached bytes live, on tmpfs", _path, "DIR",
           default=lambda values: default_cache_dir(values["source"]),
           default_text="/dev/shm/coordlfs-<uid>/<source>-<hash>"),
    Option("cache_tmpfs", "mount a tmpfs of the cache's own on the cache directory, in huge "
           "pages (huge=within_size), so that processes of coordlfs.client map it with a "
           "page fault per 2 MiB; needs root", _yes_no_auto, "yes/no/auto", default="auto",
           default_text="auto: yes as root with the default --cache-dir",
           settle=_settle_cache_tmpfs),
    Option("passthrough", "serve cached files by FUSE passthrough: the kernel reads the "
           "cache's file itself, no read reaches the daemon; needs Linux >= 6.9, CAP_SYS_ADMIN "
           "and the pyfuse3 scripts/setup builds; yes fails the mount without them",
           _yes_no_auto, "yes/no/auto", default="auto",
           default_text="auto: on where it can be had"),
    Option("request_lane", "answer opens of cached files in C, in a thread of the daemon's "
           "that reads the FUSE requests first, without the Python loop; needs passthrough and "
           "the library scripts/setup builds; yes fails the mount without them. Peers' request "
           "lanes are served in C too, unless no",
           _yes_no_auto, "yes/no/auto", default="auto",
           default_text="auto: on where passthrough is"),
    Option("lane_threads", "threads of the request lane reading FUSE requests: hits are "
           "answered on as many cores at once", _number(int, 1, 64), "N", default=1),
    Option("keep_cache", "keep the cached bytes after unmount: the next mount of the same "
           "source starts warm", default=False),
    Option("revalidate", "where the source cannot be watched for changes (network "
           "filesystems, inotify limits): how long names and attributes are trusted",
           _number(float, 0.1, 3600, unit=" seconds"), "SECONDS", default=DEFAULT_REVALIDATE,
           field="revalidate_s"),
    Option("fill_depth", "files read from the source at once filling the cache in the order "
           "jobs announced (prefetch); bounds the memory of fills in flight to N MiB; 0: off",
           _number(int, 0, 256), "N", default=DEFAULT_FILL_DEPTH),
    Option("window_size", "memory for items an aligned job read until the rest of its group "
           "has read them; 0: off", parse_size, "SIZE", default=DEFAULT_WINDOW_SIZE,
           section=GROUPS),
    Option("prefetch_depth", "storage requests in flight reading ahead of an aligned group; "
           "0: off", _number(int, 0, 64), "N", default=DEFAULT_PREFETCH_DEPTH, section=GROUPS),
    Option("staging_size", "shared memory for batches prep-sharing jobs prepared for each "
           "other; producers wait when it is full", _size_above_zero, "SIZE",
           default=DEFAULT_STAGING_SIZE, section=GROUPS),
    Option("listen", "serve the files this node caches to its peers on this address; IPv6 in "
           "brackets: [::1]:7878, [::]:7878 (every address, IPv4 too)", _address,
           "HOST:PORT", section=CLUSTER),
    Option("peers", "every node of the cluster, this one included, the same list on each: a "
           "miss is fetched from the node that caches the file", _peers, "HOST:PORT,...",
           default=(), section=CLUSTER),
    Option("peers_from", "take the nodes from the engine instead of --peers: slurm (the job's "
           "allocation, with --listen's port) or dns:NAME:PORT (every address behind NAME, "
           "as a Kubernetes headless Service gives them, re-resolved periodically)",
           _peers_from, "SOURCE", section=CLUSTER),
    Option("peers_file", "take the nodes from FILE, one HOST:PORT per line, re-read when it "
           "changes", _path, "FILE", section=CLUSTER),
    Option("secret_file", "shared secret that peers prove they hold (mode 600, 16+ bytes; "
           "never sent)", _path, "FILE", section=CLUSTER),
    Option("insecure", "peers without a secret: loopback addresses only, for tests",
           default=False, section=CLUSTER),
    Option("peer_timeout", "after this a peer is down and the reader reads local storage; "
           "also the most a frame may take either way, and 10x it closes an idle peer "
           "connection", _number(float, 0, 60, low_open=True, unit=" s"), "SECONDS",
           default=DEFAULT_PEER_TIMEOUT, section=CLUSTER),
    Option("peer_connections", "peer connections kept open at most each way (to the peers "
           "this node asks, from those that ask it); past it the least recently used idle "
           "one is closed", _number(int, 1, 4096), "N", default=DEFAULT_PEER_CONNECTIONS,
           section=CLUSTER),
    Option("metrics", "serve the mount's status as Prometheus metrics on this address "
           "(http://HOST:PORT/metrics)", _address, "HOST:PORT", section=RUN),
    Option("foreground", "do not detach; log to stderr unless --log", default=False,
           short="-f", field=None, section=RUN),
    Option("allow_other", "let other users read the mount (needs user_allow_other for "
           "non-root)", default=False, section=RUN),
    Option("log", "log file", _path, "FILE", default=_default_log,
           default_text="~/.local/state/coordlfs/<mountpoint>.log when detached",
           field="log_file", section=RUN),
    Option("debug", "log at debug level", default=False, section=RUN),
)
BY_NAME = {option.name: option for option in OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The table's options as arguments of ``parser``, grouped by section; each takes its
    text as given (or None), so that ``given`` can tell what the user gave."""
    parser.add_argument(
        "-o", dest="mount_options", metavar="OPTIONS", action="append", default=[],
        help="options as mount(8) and fstab give them: the names below with underscores, "
             "KEY=VALUE or a bare switch, separated by commas (cache_size=40G,keep_cache; "
             "peers joined with +); a flag given as well wins")
    groups = {option.section: parser.add_argument_group(option.section) for option in OPTIONS}
    for option in OPTIONS:
        default = option.stated_default()
        text = f"{option.help} (default {default})" if default else option.help
        names = [option.short, option.flag] if option.short else [option.flag]
        kind = ({"action": "store_true", "default": None} if option.parse is None
                else {"metavar": option.metavar})
        groups[option.section].add_argument(*names, dest=option.name,
                                            help=text.replace("%", "%%"), **kind)


def parse_mount_options(items: Iterable[str], sloppy: bool = False) -> dict[str, str | bool]:
    """``-o`` strings (``cache_size=40G,keep_cache,nofail``) as the table's names with their
    text, or True for a switch; a later value wins, as in mount(8). Generic mount options
    are skipped, unknown ones refused unless ``sloppy`` (mount -s)."""
    given: dict[str, str | bool] = {}
    for item in (part for text in items for part in text.split(",")):
        name, has_value, value = item.partition("=")
        option = BY_NAME.get(name)
        if not name or name in GENERIC or name.startswith("x-"):
            continue
        if option is None or not option.in_mount_options:
            if sloppy:
                continue
            known = ", ".join(o.mount_option for o in OPTIONS if o.in_mount_options)
            raise UserError(f"unknown option '{item}' (known: {known})")
        if option.parse is None:
            if has_value:
                raise UserError(f"option {name} takes no value")
            given[name] = True
        elif not value:
            raise UserError(f"option {name} needs a value ({option.mount_option})")
        else:
            given[name] = value
    return given


def given(args: argparse.Namespace, sloppy: bool = False) -> dict[str, str | bool]:
    """What the user gave, from ``-o`` and the flags (a flag wins), as text by option name."""
    from_flags = {option.name: getattr(args, option.name) for option in OPTIONS
                  if getattr(args, option.name) is not None}
    return {**parse_mount_options(args.mount_options, sloppy), **from_flags}


def parse(texts: dict[str, str | bool]) -> Values:
    """Each given option's value, parsed and range-checked: the whole check ``mount -f``
    makes, one option at a time."""
    values: Values = {}
    for name, text in texts.items():
        option = BY_NAME[name]
        values[name] = text if option.parse is None else option.parse(str(text), option.flag)
    return values


class _Resolution(dict):
    """The values by name; an option not yet resolved is, on first use, its given value or
    its default, then settled: options resolve in the order they depend on each other."""

    def __init__(self, given: Values, known: Values) -> None:
        super().__init__(known)
        self.given = given

    def __missing__(self, name: str) -> Any:
        option = BY_NAME[name]
        if name in self.given:
            value = self.given[name]
        else:
            value = option.default(self) if callable(option.default) else option.default
        if option.settle is not None:
            value = option.settle(value, self)
        self[name] = value
        return value


def resolve(values: Values, source: str, mountpoint: str) -> MountConfig:
    """The config from the parsed given ``values``: defaults filled, cross-option rules
    checked. ``source`` and ``mountpoint`` are checked directories."""
    resolved = _Resolution(values, {"source": source, "mountpoint": mountpoint})
    _check_cluster(resolved)
    _check_outside_mount(resolved)
    _check_cache_outside_source(resolved)
    names = {option.field or option.name: option.name for option in OPTIONS
             if option.in_mount_options}
    return MountConfig(**{field.name: resolved[names.get(field.name, field.name)]
                          for field in fields(MountConfig)})


def _check_cluster(values: Values) -> None:
    """The peer options together, checked here so that mistakes are one line before anything
    mounts; the daemon reads the secret file itself, so the secret never travels."""
    listen, secret_file = values["listen"], values["secret_file"]
    sources = [o.flag for o in OPTIONS if o.name in ("peers", "peers_from", "peers_file")
               and values[o.name]]
    if len(sources) > 1:
        raise UserError(f"give one of {', '.join(sources)}: each names every node")
    if listen is None and not sources:
        if secret_file or values["insecure"]:
            raise UserError("--secret-file and --insecure go with --listen and --peers")
        return
    if listen is None:
        raise UserError(f"{sources[0]} needs --listen HOST:PORT, where this node serves the "
                        "others")
    addresses = [parse_address(a, "--listen") for a in (listen, *values["peers"])]
    if values["insecure"]:
        if secret_file:
            raise UserError("give --secret-file or --insecure, not both")
        outside = [str(a) for a in addresses if not is_loopback(a)]
        if outside:
            raise UserError(f"--insecure is allowed on loopback addresses only, not "
                            f"{', '.join(outside)}; give --secret-file FILE")
    elif secret_file is None:
        raise UserError("peers need --secret-file FILE holding a shared secret (or "
                        "--insecure, on loopback only)")
    else:
        read_secret(secret_file)
    find_self(addresses[0], tuple(addresses[1:]))  # a node named twice is refused now


#: Options naming what the daemon opens by path while the mount is up: clients map the
#: cache's files by their path, the log is read while the daemon runs, the peers file is
#: re-read when it changes.
_USED_WHILE_MOUNTED = ("cache_dir", "log", "peers_file")


def _check_outside_mount(values: Values) -> None:
    """Beneath the mountpoint, such a path shows the source's file of that name (or none)
    while the mount is up, not the one the daemon made or was given."""
    mountpoint = values["mountpoint"]
    for name in _USED_WHILE_MOUNTED:
        path = values[name]
        if path and within(os.path.realpath(path), mountpoint):
            raise UserError(f"{BY_NAME[name].flag} {path} is inside the mountpoint "
                            f"{mountpoint}, which the mount hides while it is up; give a "
                            "path outside it")


def _check_cache_outside_source(values: Values) -> None:
    """Inside the source, the cache's files would show through the mount as part of the
    dataset (a job scanning it would read the cache, and each fill would change what it
    lists). Checked after the mountpoint rule, which covers a mount over the source."""
    cache_dir, source = values["cache_dir"], values["source"]
    if within(os.path.realpath(cache_dir), source):
        raise UserError(f"--cache-dir {cache_dir} is inside the source {source}, which the "
                        "mount serves: jobs would read the cache as part of the dataset; give "
                        "a path outside it")
