"""The ``coordlfs`` command. Every user-facing failure is one line and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from coordlfs import __version__
from coordlfs.config import (
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
from coordlfs.control import Control, ControlError
from coordlfs.errors import Parser, UserError, exit_status
from coordlfs.mounting import (
    check_directory,
    check_mountpoint_free,
    free_space,
    mount_at,
    spawn_daemon,
    unmount,
    usable_room,
)
from coordlfs.placement import (
    find_self,
    is_loopback,
    parse_address,
    parse_peers,
    read_secret,
)
from coordlfs.sizes import format_size, parse_size
from coordlfs.stagger import (
    JobProfile,
    catalog_job,
    default_catalog_path,
    format_report,
    load_catalog,
    measured_job,
    parse_job,
    report,
    save_profile,
)


class _InOrder(argparse.Action):
    """Collects values of several options in one list, in command-line order, tagged with
    ``const``: which job of ``stagger`` starts first depends on that order."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = values if isinstance(values, list) else [values]
        setattr(namespace, self.dest,
                [*(getattr(namespace, self.dest) or []), *((self.const, v) for v in items)])


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="coordlfs", description=__doc__)
    parser.add_argument("--version", action="version", version=f"coordlfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    m = sub.add_parser("mount", help="mount SOURCE read-only on MOUNTPOINT with the MinIO cache")
    m.add_argument("source")
    m.add_argument("mountpoint")
    m.add_argument("--cache-size", metavar="SIZE",
                   help="cache capacity: bytes with K/M/G/T suffix, or N%% of RAM (default 50%%)")
    m.add_argument("--max-file-size", metavar="SIZE",
                   help="files larger than this are streamed, never cached (default: a quarter "
                        "of the cache)")
    m.add_argument("--window-size", metavar="SIZE",
                   help="memory for items an aligned job read until its group has read them "
                        "(default 256M; 0 turns the window off)")
    m.add_argument("--prefetch-depth", metavar="N", type=int,
                   default=DEFAULT_PREFETCH_DEPTH,
                   help="storage requests in flight reading ahead of an aligned group "
                        f"(default {DEFAULT_PREFETCH_DEPTH}; 0 turns read-ahead off)")
    m.add_argument("--staging-size", metavar="SIZE",
                   help="shared memory for batches prep-sharing jobs prepared for each other "
                        "(default 2G; producers wait when it is full)")
    m.add_argument("--listen", metavar="HOST:PORT",
                   help="serve the files this node caches to its peers on this address")
    m.add_argument("--peers", metavar="HOST:PORT,...",
                   help="every node of the cluster, this one included, the same list on each: "
                        "a miss is fetched from the node that caches the file")
    m.add_argument("--secret-file", metavar="FILE",
                   help="shared secret that peers prove they hold (mode 600, 16+ bytes)")
    m.add_argument("--insecure", action="store_true",
                   help="peers without a secret (loopback addresses only, for tests)")
    m.add_argument("--peer-timeout", metavar="SECONDS", type=float,
                   default=DEFAULT_PEER_TIMEOUT,
                   help="after this a peer counts as down and the reader reads local storage "
                        f"(default {DEFAULT_PEER_TIMEOUT:g})")
    m.add_argument("--revalidate", metavar="SECONDS", type=float, default=DEFAULT_REVALIDATE,
                   help="where the source cannot be watched for changes (network filesystems, "
                        "inotify limits): how long names and attributes are trusted "
                        f"(default {DEFAULT_REVALIDATE:g})")
    m.add_argument("--cache-dir", metavar="DIR",
                   help="directory for cached bytes, on tmpfs (default under /dev/shm/coordlfs)")
    m.add_argument("--keep-cache", action="store_true",
                   help="keep the cached bytes after unmount, for the next mount of this source")
    m.add_argument("-f", "--foreground", action="store_true", help="do not detach")
    m.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    m.add_argument("--log", metavar="FILE", help="log file (default: stderr in the foreground)")
    m.add_argument("--debug", action="store_true", help="log at debug level")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to exit")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", action="store_true", help="detach now even if files are open")

    s = sub.add_parser("stats", help="cache and read statistics of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.add_argument("--since", metavar="MARK", help="only reads after this mark")

    k = sub.add_parser("mark", help="record a named point (an epoch boundary) in the statistics")
    k.add_argument("mountpoint")
    k.add_argument("name")

    g = sub.add_parser("stagger", help="predict when to start the second of two jobs that "
                                       "read one dataset (makespan for delays 0-100%%)")
    g.add_argument("--job", dest="jobs", action=_InOrder, const="job",
                   metavar="NAME:KEY=VALUE,...",
                   help="a job by hand; keys: I (training s/iteration), Wcold, Wwarm, Wconc "
                        "(I/O wait s/iteration: alone and cold, cached, both jobs on a cold "
                        "cache), iters (per epoch), epochs")
    g.add_argument("--from-catalog", dest="jobs", action=_InOrder, const="catalog", nargs="+",
                   metavar="NAME[:KEY=VALUE,...]",
                   help="jobs from the catalog, optionally with some values replaced")
    g.add_argument("--measured", dest="jobs", action=_InOrder, const="measured", nargs="+",
                   metavar="NAME[:KEY=VALUE,...]",
                   help="jobs from the step profiles on the mount given by --mount (coordlfs."
                        "torch.profiled): a run alone gives I, Wcold and Wwarm, a run beside "
                        "a partner in its group Wconc; saved to the catalog for next time")
    g.add_argument("--mount", metavar="MOUNTPOINT", help="the mount whose profiles --measured "
                                                         "reads")
    g.add_argument("--catalog", metavar="FILE",
                   help="profile catalog (default ~/.local/state/coordlfs/profiles.json)")
    g.add_argument("--json", metavar="FILE", help="also write the table and the optimum as JSON")

    # Listed for --help only: `coordlfs bench ...` goes to coordlfs.bench's own parser (main),
    # so that no other command loads a benchmark.
    sub.add_parser("bench", help="benchmarks against the page cache and baselines "
                                 "(coordlfs bench --help lists them)")
    return parser


def resolve_mount(args: argparse.Namespace) -> MountConfig:
    source = check_directory(args.source, "source")
    mountpoint = check_directory(args.mountpoint, "mountpoint")
    check_mountpoint_free(mountpoint)
    cache_dir = os.path.abspath(args.cache_dir) if args.cache_dir else default_cache_dir(source)
    if args.cache_size is None:
        cache_size = default_cache_size()
    else:
        cache_size = parse_size(args.cache_size, "--cache-size")
    room = usable_room(free_space(cache_dir))
    if cache_size > room and not os.path.isdir(cache_dir):
        print(f"coordlfs: warning: --cache-size {format_size(cache_size)} is more than the "
              f"{format_size(room)} free for {cache_dir} (less a margin); using "
              f"{format_size(room)}",
              file=sys.stderr)
        cache_size = room
    if args.max_file_size is None:
        max_file = int(cache_size * DEFAULT_MAX_FILE_SHARE)
    else:
        max_file = parse_size(args.max_file_size, "--max-file-size")
    window = (DEFAULT_WINDOW_SIZE if args.window_size is None
              else parse_size(args.window_size, "--window-size"))
    staging = (DEFAULT_STAGING_SIZE if args.staging_size is None
               else parse_size(args.staging_size, "--staging-size"))
    if staging <= 0:
        raise UserError(f"bad --staging-size {args.staging_size}: must be more than 0")
    log_file = args.log or (None if args.foreground else default_log_file(mountpoint))
    if not 0 <= args.prefetch_depth <= 64:
        raise UserError(f"bad --prefetch-depth {args.prefetch_depth}: 0 to 64")
    if not 0.1 <= args.revalidate <= 3600:
        raise UserError(f"bad --revalidate {args.revalidate:g}: 0.1 to 3600 seconds")
    return MountConfig(source, mountpoint, cache_size, max_file, cache_dir, window,
                       args.prefetch_depth, staging, revalidate_s=args.revalidate,
                       keep_cache=args.keep_cache,
                       allow_other=args.allow_other,
                       log_file=log_file and os.path.abspath(log_file), debug=args.debug,
                       **_resolve_cluster(args))


def _resolve_cluster(args: argparse.Namespace) -> dict[str, Any]:
    """The peer options, checked here so that mistakes are one line before anything mounts;
    the daemon reads the secret file itself, so the secret never travels in argv."""
    if args.listen is None and args.peers is None:
        if args.secret_file or args.insecure:
            raise UserError("--secret-file and --insecure go with --listen and --peers")
        return {}
    if args.listen is None:
        raise UserError("--peers needs --listen HOST:PORT, where this node serves the others")
    listen = parse_address(args.listen, "--listen")
    peers = parse_peers(args.peers) if args.peers is not None else ()
    if args.insecure:
        if args.secret_file:
            raise UserError("give --secret-file or --insecure, not both")
        outside = [str(a) for a in (listen, *peers) if not is_loopback(a)]
        if outside:
            raise UserError(f"--insecure is allowed on loopback addresses only, not "
                            f"{', '.join(outside)}; give --secret-file FILE")
    elif args.secret_file is None:
        raise UserError("peers need --secret-file FILE holding a shared secret (or "
                        "--insecure, on loopback only)")
    else:
        read_secret(args.secret_file)
    if not 0 < args.peer_timeout <= 60:
        raise UserError(f"bad --peer-timeout {args.peer_timeout:g}: more than 0, at most 60 s")
    find_self(listen, peers)  # a node named twice is refused now
    return {"listen": str(listen), "peers": tuple(str(p) for p in peers),
            "secret_file": args.secret_file and os.path.abspath(args.secret_file),
            "insecure": args.insecure, "peer_timeout": args.peer_timeout}


def _daemon_argv(config: MountConfig) -> list[str]:
    argv = ["mount", config.source, config.mountpoint, "--cache-size", str(config.cache_size),
            "--max-file-size", str(config.max_file_size), "--cache-dir", config.cache_dir,
            "--window-size", str(config.window_size),
            "--prefetch-depth", str(config.prefetch_depth),
            "--staging-size", str(config.staging_size),
            "--revalidate", str(config.revalidate_s)]
    if config.log_file:
        argv += ["--log", config.log_file]
    if config.listen:
        argv += ["--listen", config.listen, "--peer-timeout", str(config.peer_timeout)]
    if config.peers:
        argv += ["--peers", ",".join(config.peers)]
    if config.secret_file:
        argv += ["--secret-file", config.secret_file]
    for flag, on in (("--keep-cache", config.keep_cache), ("--allow-other", config.allow_other),
                     ("--insecure", config.insecure), ("--debug", config.debug)):
        if on:
            argv.append(flag)
    return argv


def cmd_mount(args: argparse.Namespace) -> int:
    config = resolve_mount(args)
    summary = (f"{config.source} on {config.mountpoint}, cache {format_size(config.cache_size)}"
               f"{' (default: 50% of RAM)' if args.cache_size is None else ''} in "
               f"{config.cache_dir}")
    if not args.foreground:
        freshness = spawn_daemon(_daemon_argv(config), config.log_file or "")
        print(f"coordlfs: mounted {summary}; {freshness}; log {config.log_file}")
        return 0
    return _run_foreground(config, args.ready_fd, summary)


def _run_foreground(config: MountConfig, ready_fd: int | None, summary: str) -> int:
    from coordlfs.daemon import Daemon, setup_logging

    def report(line: str) -> None:
        if ready_fd is not None:
            os.write(ready_fd, line.encode() + b"\n")
            os.close(ready_fd)
        elif line.startswith("ok"):
            print(f"coordlfs: mounted {summary}; {line[2:].strip()}", flush=True)

    setup_logging(config.log_file, config.debug)
    try:
        daemon = Daemon(config)
        daemon.run(lambda note: report(f"ok {note}"))
    except UserError as e:
        if ready_fd is None:
            raise
        report(f"error {e}")
        return 1
    return 0


def _control(mountpoint: str) -> Control:
    entry = mount_at(mountpoint)
    if entry is None or entry.fstype != "fuse.coordlfs":
        raise UserError(f"{mountpoint} is not a coordlfs mount")
    return Control(mountpoint)


def cmd_umount(args: argparse.Namespace) -> int:
    control = _control(args.mountpoint)
    try:
        pid = control.status()["pid"]
    except (ControlError, OSError, ValueError, KeyError):
        pid = None  # a dead daemon: unmount anyway
    unmount(os.path.realpath(args.mountpoint), pid, args.lazy)
    return 0


def _table(status: dict[str, Any], interval: dict[str, Any] | None) -> str:
    cache, reads = status["cache"], (interval or status)["reads"]
    served = reads["cache_hits"] + reads["misses"]
    rate = f"{100 * reads['cache_hits'] / served:.1f}%" if served else "-"
    held = status["read_window"]
    lines = [
        f"coordlfs {status['version']} on {status['mountpoint']} "
        f"(source {status['source']}, pid {status['pid']})",
        f"cache    {format_size(cache['used_bytes'])} of {format_size(cache['capacity_bytes'])} "
        f"used, {cache['files']} files ({cache['filling']} filling)",
        f"window   {format_size(held['used_bytes'])} of {format_size(held['capacity_bytes'])} "
        f"held for aligned groups, {held['items']} items, {held['hits']} taken",
    ]
    if interval:
        lines.append(f"between  {interval['since']} .. {interval['until']} "
                     f"({interval['seconds']:.1f} s)")
    lines += [
        f"reads    {reads['cache_hits']} hits, {reads['misses']} misses, hit rate {rate}",
        f"bytes    {format_size(reads['bytes_from_cache'])} from cache, "
        f"{format_size(reads['bytes_from_source'])} from source, "
        f"{format_size(reads['bytes_from_peers'])} from peers",
        f"files    {reads['files_from_source']} from source, {reads['files_from_peers']} from "
        "peers",
    ]
    lines += _peer_lines(status)
    for name, group in status["groups"].items():
        members = ", ".join(f"{m['job']} (pid {m['pid']})" for m in group["members"])
        lines.append(f"group    {name}: seed {group['seed']}, members {members}")
    lines += _prep_lines(status["prep"])
    for profile in status["profiles"]:
        for epoch, p in profile["epochs"].items():
            total = p["wait_s"] + p["step_s"]
            stall = f"{100 * p['wait_s'] / total:.1f}%" if total else "-"
            lines.append(f"profile  {profile['job']} (pid {profile['pid']}) epoch {epoch}: "
                         f"{p['steps']} steps, waited {p['wait_s']:.2f} s, stepped "
                         f"{p['step_s']:.2f} s, stall {stall}")
    return "\n".join(lines)


def _prep_lines(prep: dict[str, Any]) -> list[str]:
    staging = prep["staging"]
    if not prep["groups"] and not staging["published"]:
        return []
    lines = [f"staging  {format_size(staging['used_bytes'])} of "
             f"{format_size(staging['capacity_bytes'])} (peak "
             f"{format_size(staging['peak_bytes'])}), {staging['published']} batches "
             f"published, {staging['released']} released, {staging['taken_over']} taken over, "
             f"{staging['expelled']} members expelled"]
    for name, group in prep["groups"].items():
        epoch = group["epoch"]
        state = ("between epochs" if epoch is None else
                 f"epoch {epoch['number']}: {epoch['staged']} staged "
                 f"({format_size(epoch['staged_bytes'])}), {epoch['released']} of "
                 f"{group['batches']} released")
        members = ", ".join(f"{m['job']} (pid {m['pid']}, prepared {m['prepared']})"
                            for m in group["members"])
        lines.append(f"prep     {name}: {state}; members {members}")
    return lines


def _peer_lines(status: dict[str, Any]) -> list[str]:
    peers, served = status["peers"], status["served"]
    if not peers["links"] and served is None:
        return []
    lines = [f"cluster  this node {peers['self'] or '(not in --peers)'}, "
             f"{len(peers['nodes'])} nodes"]
    for address, link in peers["links"].items():
        error = f", last error: {link['last_error']}" if link["last_error"] else ""
        retry = f", retry in {link['retry_in_s']:.0f} s" if link["state"] == "down" else ""
        lines.append(f"peer     {address} {link['state']}{retry}: {link['files']} files, "
                     f"{format_size(link['bytes'])}, {link['misses']} misses, "
                     f"{link['stale']} stale, {link['failures']} failures{error}")
    if served is not None:
        lines.append(f"served   {served['requests']} requests, {format_size(served['bytes'])} "
                     f"to peers, {served['refused']} refused")
    return lines


def cmd_stats(args: argparse.Namespace) -> int:
    control = _control(args.mountpoint)
    status = control.status()
    interval = control.stats(since=args.since) if args.since else None
    if args.json:
        print(json.dumps({**status, "window": interval} if interval else status, indent=2))
    else:
        print(_table(status, interval))
    return 0


def cmd_mark(args: argparse.Namespace) -> int:
    _control(args.mountpoint).mark(args.name)
    return 0


def _stagger_jobs(args: argparse.Namespace) -> list[JobProfile]:
    specs = args.jobs or []
    path = args.catalog or default_catalog_path()
    catalog = load_catalog(path) if any(kind == "catalog" for kind, _ in specs) else {}
    profiles: list[dict[str, Any]] = []
    if any(kind == "measured" for kind, _ in specs):
        if args.mount is None:
            raise UserError("--measured needs --mount MOUNTPOINT")
        profiles = _control(args.mount).status()["profiles"]
    jobs = []
    for kind, spec in specs:
        if kind == "job":
            jobs.append(parse_job(spec))
        elif kind == "catalog":
            jobs.append(catalog_job(spec, catalog, path))
        else:
            jobs.append(measured_job(spec, profiles))
            save_profile(path, jobs[-1])  # measured once, reused later from the catalog
    if len(jobs) != 2:
        raise UserError(f"needs two jobs (--job, --from-catalog); the model covers pairs, "
                        f"got {len(jobs)}")
    return jobs


def cmd_stagger(args: argparse.Namespace) -> int:
    try:
        jobs = _stagger_jobs(args)
    except UserError as e:  # bad arguments: status 2, like argparse's own errors
        print(f"coordlfs stagger: {e}", file=sys.stderr)
        return 2
    data = report(jobs)
    print(format_report(data))
    if args.json:
        try:
            with open(args.json, "w") as f:
                f.write(json.dumps(data, indent=2) + "\n")
        except OSError as e:
            raise UserError(f"cannot write {args.json}: {e.strerror or e}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from coordlfs.bench import main as bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    commands = {"mount": cmd_mount, "umount": cmd_umount, "stats": cmd_stats, "mark": cmd_mark,
                "stagger": cmd_stagger}
    return exit_status("coordlfs", lambda: commands[args.command](args))
