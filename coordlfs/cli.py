"""The ``coordlfs`` command. Every user-facing failure is one line and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from coordlfs import __version__
from coordlfs.daemon import options
from coordlfs.daemon.config import MountConfig
from coordlfs.daemon.mounting import (
    check_directory,
    check_mountpoint_free,
    check_mountpoint_outside,
    spawn_daemon,
    unmount,
    warn_if_not_empty,
)
from coordlfs.errors import Parser, UserError, exit_status, quiet_on_closed_pipe
from coordlfs.models.stagger import (
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
from coordlfs.protocol.client import Control, ControlError
from coordlfs.sizes import format_size, plural
from coordlfs.system.mounts import mount_at


class _InOrder(argparse.Action):
    """Collects values of several options in one list, in command-line order, tagged with
    ``const``: which job of ``stagger`` starts first depends on that order."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = values if isinstance(values, list) else [values]
        setattr(namespace, self.dest,
                [*(getattr(namespace, self.dest) or []), *((self.const, v) for v in items)])


#: what a command's piece of the parser is added to
Subparsers = argparse._SubParsersAction


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, a piece per command (``_COMMANDS``, in the order ``--help``
    lists them); the mount's options come from their table (``daemon.options``)."""
    parser = Parser(prog="coordlfs", description=__doc__)
    parser.add_argument("--version", action="version", version=f"coordlfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in _COMMANDS:
        add(sub)
    return parser


def _add_mount(sub: Subparsers) -> None:
    m = sub.add_parser("mount", help="mount SOURCE read-only on MOUNTPOINT with a no-eviction "
                       "cache",
                       description="Mount SOURCE read-only on MOUNTPOINT with a no-eviction "
                                   "cache; return once the mount is live.")
    m.add_argument("source")
    m.add_argument("mountpoint")
    options.add_arguments(m)
    # For the mount(8) helper (mount/mount.fuse.coordlfs): mount -f and mount -s.
    m.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)
    m.add_argument("--sloppy", action="store_true", help=argparse.SUPPRESS)


def _add_umount(sub: Subparsers) -> None:
    u = sub.add_parser("umount", help="unmount and wait for the daemon to exit")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", action="store_true", help="detach now even if files are open")


def _add_stats(sub: Subparsers) -> None:
    s = sub.add_parser("stats", help="cache and read statistics of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.add_argument("--since", metavar="MARK", help="only reads after this mark (with --json the "
                                                   "top level is this window; the counts since "
                                                   "mount are under \"total\")")
    s.add_argument("--until", metavar="MARK", help="only reads before this mark: a window that "
                                                   "closed, such as one epoch between two marks")


def _add_warm(sub: Subparsers) -> None:
    a = sub.add_parser(
        "warm", help="fill a mount's cache with files ahead of a job, in its order",
        description="Fill the cache of the coordlfs mount holding PATHs with their files "
                    "(a directory: every file under it, depth first in name order, as "
                    "ImageFolder indexes them), in this order, up to the cache's capacity. "
                    "On a cluster each node caches its own share; files already cached are "
                    "not read again, so a run stopped by Ctrl-C resumes where it was. Exits "
                    "1 if files failed or none could be cached (it says why), 130 when "
                    "interrupted.")
    a.add_argument("paths", nargs="*", metavar="PATH", help="files or directories on a "
                                                            "coordlfs mount")
    a.add_argument("--from-file", metavar="LIST", help="also the paths in LIST, one per line "
                                                       "(- for stdin)")
    a.add_argument("--order", metavar="SEED:N", help="in the shuffled order a job of seed "
                   "SEED reads in epoch N (0 for the first; AlignedSampler.set_epoch's "
                   "number): coordlfs.protocol.order.epoch_order over the files as listed")
    a.add_argument("--all-nodes", action="store_true", help="ask every peer of the mount to "
                   "warm its share of the same files too")
    a.add_argument("--json", action="store_true", help="print a JSON summary at the end "
                                                       "instead of lines")
    a.add_argument("--check", action="store_true", help="only say how much of PATHs the "
                   "cache holds now (files, bytes, percent); fill nothing")


def _add_mark(sub: Subparsers) -> None:
    k = sub.add_parser("mark", help="record a named point (an epoch boundary) in the statistics")
    k.add_argument("mountpoint")
    k.add_argument("name")


def _add_stagger(sub: Subparsers) -> None:
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


def _add_whatif(sub: Subparsers) -> None:
    w = sub.add_parser("whatif", help="predict epoch time and stalls for other cache sizes, "
                                      "CPU counts and storage speeds from a run's rates")
    w.add_argument("mountpoint")
    w.add_argument("--since", metavar="MARK", help="only epochs (intervals between marks) "
                                                   "from this mark on")
    w.add_argument("--json", metavar="FILE", help="also write the analysis as JSON")
    w.add_argument("--plot", metavar="FILE.png", help="plot epoch time and stall share")


def _add_run(sub: Subparsers) -> None:
    r = sub.add_parser(
        "run", help="run a command whose opens of cached files skip FUSE (preload library)",
        description="Run CMD with coordlfs's preload library, so that its opens of files on "
                    "coordlfs mounts (every one this user may read, or those named) are served "
                    "from the cache's own files or the source without a FUSE round trip. "
                    "Exits with CMD's status.")
    r.add_argument("--mount", action="append", default=[], metavar="MNT",
                   help="serve this mount only (repeatable; default: every coordlfs mount)")
    r.add_argument("--print-env", nargs="?", const="sh", choices=("sh", "slurm"),
                   help="print the variables instead of running a command: sh (for eval) "
                        "or slurm (a TaskProlog's export lines)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")


def _add_bench(sub: Subparsers) -> None:
    # Listed for --help only: `coordlfs bench ...` goes to coordlfs.bench's own parser (main),
    # so that no other command loads a benchmark.
    sub.add_parser("bench", help="benchmarks against the page cache and baselines "
                                 "(coordlfs bench --help lists them)")


#: the commands, in the order ``coordlfs --help`` lists them
_COMMANDS = (_add_mount, _add_umount, _add_stats, _add_warm, _add_mark, _add_stagger,
             _add_whatif, _add_run, _add_bench)


def cmd_mount(args: argparse.Namespace) -> int:
    given = options.given(args, args.sloppy)
    values = options.parse(given)
    if args.fake:  # mount -f: the options are checked, nothing is mounted
        return 0
    source = check_directory(args.source, "source")
    mountpoint = check_directory(args.mountpoint, "mountpoint")
    check_mountpoint_free(mountpoint)
    check_mountpoint_outside(mountpoint, source)
    warn_if_not_empty(mountpoint, source)
    config = options.resolve(values, source, mountpoint)
    summary = _mount_summary(config, given)
    if not values.get("foreground"):
        freshness = spawn_daemon(config)
        print(f"coordlfs: mounted {summary}; {freshness}; log {config.log_file}")
        return 0
    return _run_foreground(config, summary)


def _mount_summary(config: MountConfig, given: dict[str, Any]) -> str:
    """What the mount's first line says of it: where, the cache, and the largest file it
    caches (larger ones are read from the source every time, which a user otherwise finds
    out only from an epoch that never gets faster); a default is said to be one."""
    summary = (f"{config.source} on {config.mountpoint}, cache {format_size(config.cache_size)}"
               f"{_defaulted('cache_size', given, ' (default: {})')} in {config.cache_dir}")
    if not config.cache_size:  # no cache: nothing is cached, whatever the size
        return summary
    return (f"{summary}; files over {format_size(config.max_file_size)} are not cached "
            f"(--max-file-size{_defaulted('max_file_size', given, ', default: {}')})")


def _defaulted(option: str, given: dict[str, Any], note: str) -> str:
    """``note`` naming an option's default, where the user did not give the option."""
    return "" if option in given else note.format(options.BY_NAME[option].default_text)


def _run_foreground(config: MountConfig, summary: str) -> int:
    from coordlfs.daemon.daemon import Daemon, setup_logging

    setup_logging(config.log_file, config.debug)
    Daemon(config).run(lambda note: print(f"coordlfs: mounted {summary}; {note}", flush=True))
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
    mountpoint = os.path.realpath(args.mountpoint)
    unmount(mountpoint, pid, args.lazy)
    print(f"coordlfs: unmounted {mountpoint}")
    return 0


def _passthrough_line(state: dict[str, Any] | None, reads: dict[str, int]) -> str:
    """On (opens the kernel serves itself) or off and why."""
    if state is None:  # a daemon older than passthrough
        return "passthrough off: the daemon predates it"
    if not state["on"]:
        return f"passthrough off: {state['why_off']}"
    lane = state.get("lane")
    answered = ("; request lane off" if not lane else
                f"; {lane['opens'] + lane.get('source_opens', 0)} of them answered in C by "
                "the request lane")
    return (f"passthrough on: {plural(reads['passthrough_opens'], 'open')} read by the "
            f"kernel from the cache, {reads['source_opens']} from the source{answered}")


def _read_lines(reads: dict[str, int]) -> list[str]:
    """Files opened by what served them (whoever served them: the daemon, the kernel, a
    client, ``coordlfs run``), bytes by where they came from, and the read requests the
    daemon answered: three counts of one epoch that differ by design, each named."""
    hits, misses, peer_hits = reads["file_hits"], reads["file_misses"], reads["file_peer_hits"]
    opened = hits + misses + peer_hits
    files_rate = f"{100 * hits / opened:.1f}%" if opened else "-"
    # of bytes: the kernel reads passthrough opens without the daemon counting their reads
    served = reads["bytes_from_cache"] + reads["bytes_from_source"] + reads["bytes_from_peers"]
    bytes_rate = f"{100 * reads['bytes_from_cache'] / served:.1f}%" if served else "-"
    requests = reads["read_hits"] + reads["read_misses"]
    # fills that found the file's pages in memory (another process had read it): not storage
    paged = reads.get("fill_bytes_from_pages", 0)  # a daemon older than the count: none
    in_memory = f" ({format_size(paged)} of it from pages in memory)" if paged else ""
    return [
        f"files    {opened} opened: {plural(hits, 'hit')} (cache), {plural(misses, 'miss')} "
        f"(source), {plural(peer_hits, 'peer hit')}; {files_rate} hits",
        f"bytes    {format_size(reads['bytes_from_cache'])} from cache, "
        f"{format_size(reads['bytes_from_source'])} from source{in_memory}, "
        f"{format_size(reads['bytes_from_peers'])} from peers; {bytes_rate} from cache",
        f"requests {plural(requests, 'read')} answered by the daemon: {reads['read_hits']} "
        f"from the cache, {reads['read_misses']} from fills, the source or peers",
    ]


def _memory_line(status: dict[str, Any], cache: dict[str, Any]) -> str:
    """What the mount needs beside its cached bytes: the figures a memory budget is split by
    (``coordlfs.daemon.memory``); a daemon older than them gives its tables alone."""
    memory = status.get("memory")
    pages = format_size(cache["used_bytes"] - cache["bytes"])
    if memory is None:
        return (f"memory   {cache['table_bytes'] / max(1, cache['files'] + cache['filling']):.0f}"
                f" B per cached file (the daemon's table), pages {pages} beyond the bytes")
    return (f"memory   daemon {format_size(memory['daemon_bytes'])} "
            f"({format_size(memory['itself_bytes'])} itself), "
            f"{memory['per_cached_file_bytes']} B per cached file, "
            f"{memory['per_inode_bytes']} B per file looked up (daemon and kernel); pages "
            f"{pages} beyond the bytes")


def _table(status: dict[str, Any], interval: dict[str, Any] | None) -> str:
    cache, reads = status["cache"], (interval or status)["reads"]
    held = status["read_window"]
    lines = [
        f"coordlfs {status['version']} on {status['mountpoint']} "
        f"(source {status['source']}, pid {status['pid']})",
        f"cache    {format_size(cache['used_bytes'])} of {format_size(cache['capacity_bytes'])} "
        f"used, {plural(cache['files'], 'file')} ({cache['filling']} filling)",
        _memory_line(status, cache),
        f"window   {format_size(held['used_bytes'])} of {format_size(held['capacity_bytes'])} "
        f"held for aligned groups, {plural(held['items'], 'item')}, {held['hits']} taken",
    ]
    if interval:
        lines.append(f"between  {interval['since']} .. {interval['until']} "
                     f"({interval['seconds']:.1f} s)")
    lines += _read_lines(reads)
    lines.append(_passthrough_line(status.get("passthrough"), reads))
    direct = reads["client_direct"]
    if reads["client_hits"] or reads["client_misses"] or direct:
        lines.append(f"clients  {plural(reads['client_hits'], 'hit')} "
                     f"({format_size(reads['client_bytes_from_cache'])}) from shared memory, "
                     f"{plural(reads['client_misses'], 'read')} "
                     f"({format_size(reads['client_bytes_from_mount'])}) through the mount, "
                     f"{direct} ({format_size(reads['client_bytes_direct'])}) "
                     "from the source directly")
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
                         f"{plural(p['steps'], 'step')}, waited {p['wait_s']:.2f} s, stepped "
                         f"{p['step_s']:.2f} s, stall {stall}")
    return "\n".join(lines)


def _prep_lines(prep: dict[str, Any]) -> list[str]:
    staging = prep["staging"]
    if not prep["groups"] and not staging["published"]:
        return []
    lines = [f"staging  {format_size(staging['used_bytes'])} of "
             f"{format_size(staging['capacity_bytes'])} (peak "
             f"{format_size(staging['peak_bytes'])}), "
             f"{plural(staging['published'], 'batch')} published, "
             f"{staging['released']} released, {staging['taken_over']} taken over, "
             f"{plural(staging['expelled'], 'member')} expelled"]
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
    since = time.strftime("%H:%M:%S", time.localtime(peers["changed_at"]))
    lines = [f"cluster  this node {peers['self'] or '(not among the nodes)'}, "
             f"{plural(len(peers['nodes']), 'node')} from {peers['source']} "
             f"({plural(peers['changes'], 'change')}, as of {since})"]
    for address, link in peers["links"].items():
        error = f", last error: {link['last_error']}" if link["last_error"] else ""
        retry = f", retry in {link['retry_in_s']:.0f} s" if link["state"] == "down" else ""
        lines.append(f"peer     {address} {link['state']}{retry}: "
                     f"{plural(link['files'], 'file')}, {format_size(link['bytes'])}, "
                     f"{plural(link['misses'], 'miss')}, {link['stale']} stale, "
                     f"{plural(link['failures'], 'failure')}{error}")
    if served is not None:
        in_c = "" if served.get("in_c") is None else f" ({served['in_c']['files']} sent in C)"
        lines.append(f"served   {plural(served['requests'], 'request')}{in_c}, "
                     f"{format_size(served['bytes'])} "
                     f"to peers, {served['refused']} refused")
    return lines


def cmd_stats(args: argparse.Namespace) -> int:
    control = _control(args.mountpoint)
    status = control.status()
    interval = (control.stats(since=args.since, until=args.until)
                if args.since or args.until else None)
    if args.json:
        print(json.dumps(_windowed(status, interval), indent=2))
    else:
        print(_table(status, interval))
    return 0


#: What the ``stats`` command says of its window itself, beside the counters it windows.
_WINDOW = ("since", "until", "seconds")


def _windowed(status: dict[str, Any], interval: dict[str, Any] | None) -> dict[str, Any]:
    """The status as ``--json`` prints it: with a window (``--since``/``--until``), each
    counter the window has (``reads``) is the window's at the top level, where a script
    looks first, and the cumulative one is under ``total``; ``window`` says which."""
    if interval is None:
        return status
    counted = [key for key in interval if key not in _WINDOW]
    return {**status, **{key: interval[key] for key in counted},
            "window": {key: interval[key] for key in _WINDOW},
            "total": {key: status[key] for key in counted}}


def cmd_mark(args: argparse.Namespace) -> int:
    _control(args.mountpoint).mark(args.name)
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    from coordlfs.client import warm_files
    from coordlfs.client.warm import Interrupted, WarmRun, check, nothing_cached, walk
    from coordlfs.client.warm_progress import check_line, display, summary_lines

    try:
        order = warm_files.parse_order(args.order) if args.order else None
    except ValueError as e:  # bad arguments: status 2, like argparse's own errors
        print(f"coordlfs warm: {e}", file=sys.stderr)
        return 2
    listing = warm_files.Listing(args.paths, warm_files.listed(args.from_file)
                                 if args.from_file else ())
    shown = display(args.json)
    try:
        files = walk(listing, shown)
        if args.check:
            shown.close()
            held = check(Control(files.mount), files)
            print(json.dumps(held, indent=2) if args.json else check_line(held))
            return 0
        if order is not None:
            files.reorder(*order)
        summary = WarmRun(Control(files.mount), files, shown, args.all_nodes).run()
    except Interrupted as e:
        print(f"coordlfs warm: {e}", file=sys.stderr)
        return 130
    print(json.dumps(summary, indent=2) if args.json else "\n".join(summary_lines(summary)))
    failed = summary["failed"] or any("error" in node for node in summary["nodes"].values())
    why = nothing_cached(summary)
    if why is not None:
        print(f"coordlfs warm: nothing was cached: {why}", file=sys.stderr)
    return 1 if failed or why is not None else 0


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


def cmd_whatif(args: argparse.Namespace) -> int:
    from coordlfs.models import whatif

    control = _control(args.mountpoint)
    data = whatif.analyse(control.status(), control.marks(), control.stats(since=args.since),
                          args.since, os.cpu_count() or 1)
    print(whatif.format_report(data))
    whatif.write_outputs(data, args.json, args.plot)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from coordlfs.client import run

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.print_env:
        if command:
            raise UserError("--print-env runs no command")
        return run.print_env(args.mount, args.print_env)
    return run.run(args.mount, command)


def main(argv: list[str] | None = None) -> int:
    """``coordlfs ARGV``: its exit status; a closed pipe on stdout ends it quietly."""
    return quiet_on_closed_pipe(lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:
        from coordlfs.bench import main as bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    commands = {"mount": cmd_mount, "umount": cmd_umount, "stats": cmd_stats, "mark": cmd_mark,
                "warm": cmd_warm, "stagger": cmd_stagger, "whatif": cmd_whatif,
                "run": cmd_run}
    return exit_status("coordlfs", lambda: commands[args.command](args),
                       sigterm_interrupts=args.command == "warm")
