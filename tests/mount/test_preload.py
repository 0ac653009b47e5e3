"""``coordlfs run`` and its preload library on a real mount: every byte a preloaded job reads
equals the source, whichever way it opens files (Python, os, fopen, mmap, numpy, threads,
fork, exec, a DataLoader's workers); hits come from the cache's files and misses from the
source with no FUSE request, and both are counted; a change in the source is seen as through
the mount; a user who may not open the cache, a static binary, a dead daemon and a missing
library all get what the mount gives."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from conftest import (
    COORDLFS,
    digests,
    force_unmount,
    make_dataset,
    reachable_by_anyone,
    run_as_other_user,
    run_cli,
    wait_for,
)
from test_metrics import free_port

from coordlfs.client.run import LIBRARY, environment, library
from coordlfs.testbed.scrape import scrape, value

READER = Path(__file__).with_name("preload_reader.py")

pytestmark = pytest.mark.skipif(library() is None,
                                reason="the preload library is not built (scripts/setup)")


def preloaded(mode: str, root: Path, names: list[str], *run_args: str,
              env: dict[str, str] | None = None) -> dict[str, str]:
    """The digests (or errnos) a job under ``coordlfs run`` read, by name; the library was
    loaded in it."""
    done = subprocess.run([*COORDLFS, "run", "--mount", str(root), *run_args, "--",
                           sys.executable, str(READER),
                           mode, str(root), *names], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["preloaded"], "the library was not loaded"
    return out["digests"]


def reads(m) -> dict[str, int]:
    return m.settled()["reads"]


@pytest.fixture
def served(mount, tmp_path):
    """A mount of 60 image-sized files, and their digests."""
    source = tmp_path / "data"
    source.mkdir()
    make_dataset(source, 60)
    return mount(source), digests(source)


def test_misses_then_hits_byte_for_byte_with_no_fuse_request(served) -> None:
    m, expected = served
    names = sorted(expected)
    assert preloaded("open", m.mountpoint, names) == expected
    first = reads(m)
    assert first["preload_misses"] == len(names)
    assert first["preload_hits"] == 0
    assert first["passthrough_opens"] == 0 and first["source_opens"] == 0  # no FUSE open
    # the backfills the job's reads, told at its closes
    wait_for(lambda: m.status()["shared"]["published"] == len(names), "every file published")
    assert m.status()["cache"]["files"] == len(names)
    assert preloaded("os", m.mountpoint, names) == expected
    second = reads(m)
    assert second["preload_hits"] == len(names)
    assert second["preload_bytes_from_cache"] == sum(
        (m.source / n).stat().st_size for n in names)
    assert second["passthrough_opens"] == 0 and second["read_hits"] == 0
    # the files counted as any reader's: each open once, whoever served it
    assert (first["file_misses"], first["file_hits"]) == (len(names), 0)
    assert second["file_hits"] == len(names) and second["file_misses"] == len(names)


@pytest.mark.parametrize("mode", ["fopen", "mmap", "numpy", "threads", "fork", "exec"])
def test_every_way_of_opening_reads_the_source_bytes(served, mode) -> None:
    m, expected = served
    names = sorted(expected)
    assert preloaded(mode, m.mountpoint, names) == expected  # misses
    wait_for(lambda: m.status()["shared"]["published"] == len(names), "every file published")
    assert preloaded(mode, m.mountpoint, names) == expected  # hits
    counted = reads(m)
    assert (counted["preload_hits"], counted["preload_misses"]) == (len(names), len(names)), \
        {k: v for k, v in counted.items() if v}


def test_a_dataloader_with_workers_decodes_images_from_the_cache(mount, tmp_path) -> None:
    pytest.importorskip("torch")
    image = pytest.importorskip("PIL.Image")
    source = tmp_path / "images"
    (source / "cat").mkdir(parents=True)
    for i in range(12):
        pixels = bytes((i * 7 + j) % 256 for j in range(32 * 32 * 3))
        image.frombytes("RGB", (32, 32), pixels).save(source / "cat" / f"{i}.png")
    m = mount(source)
    names = [f"cat/{i}.png" for i in range(12)]
    want = {n: xxhash.xxh64_hexdigest(image.open(source / n).convert("RGB").tobytes())
            for n in names}
    assert preloaded("pil", m.mountpoint, names) == want
    wait_for(lambda: m.status()["shared"]["published"] == len(names), "every file published")
    assert preloaded("pil", m.mountpoint, names) == want
    assert reads(m)["preload_hits"] >= len(names)  # PIL may open a file more than once


def test_a_held_hit_keeps_its_bytes_and_the_next_open_sees_the_change(served) -> None:
    m, expected = served
    name = sorted(expected)[0]
    preloaded("open", m.mountpoint, [name])
    wait_for(lambda: m.status()["shared"]["published"] == 1, "published")
    old = (m.source / name).read_bytes()
    script = (
        "import os, sys, mmap, time\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "sys.stdout.write('opened\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
        "size = os.fstat(fd).st_size\n"
        "with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm: mapped = mm[:]\n"
        "data = os.pread(fd, size + 1, 0)\n"
        "sys.stdout.buffer.write(data if data == mapped else b'MISMATCH')\n")
    job = subprocess.Popen([*COORDLFS, "run", "--", sys.executable, "-c", script,
                            str(m.mountpoint / name)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)
    assert job.stdout is not None and job.stdin is not None
    assert job.stdout.readline() == b"opened\n"
    new = os.urandom(len(old) * 2)  # longer: a size the old file cannot give
    (m.source / "replacement").write_bytes(new)
    os.rename(m.source / "replacement", m.source / name)
    out, _ = job.communicate(b"go\n", timeout=60)
    assert out == old  # the version it opened, whole, by read and by mmap
    wait_for(lambda: preloaded("open", m.mountpoint, [name])[name]
             == xxhash.xxh64_hexdigest(new), "the new version read by the next open")


def test_a_rewrite_in_place_between_opens_is_seen(served) -> None:
    m, expected = served
    name = sorted(expected)[1]
    preloaded("open", m.mountpoint, [name])
    wait_for(lambda: m.status()["shared"]["published"] == 1, "published")
    new = os.urandom(4096)
    with open(m.source / name, "r+b") as f:  # same inode
        f.truncate(0)
        f.write(new)
    wait_for(lambda: preloaded("os", m.mountpoint, [name])[name]
             == xxhash.xxh64_hexdigest(new), "the rewrite read by the next open")


def test_a_static_binary_reads_through_the_mount(served, tmp_path) -> None:
    m, expected = served
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    program = tmp_path / "cat.c"
    program.write_text(
        "#include <fcntl.h>\n#include <unistd.h>\n"
        "int main(int c, char **v) { char b[65536]; int fd = open(v[1], O_RDONLY);"
        " if (fd < 0) return 2; ssize_t n; while ((n = read(fd, b, sizeof b)) > 0)"
        " write(1, b, n); return n < 0; }\n")
    binary = tmp_path / "static-cat"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(binary), str(program)], check=True)
    name = sorted(expected)[2]
    done = subprocess.run([*COORDLFS, "run", "--", str(binary), str(m.mountpoint / name)],
                          capture_output=True, timeout=60)
    assert done.returncode == 0
    assert xxhash.xxh64_hexdigest(done.stdout) == expected[name]
    counted = reads(m)
    assert counted["preload_misses"] == 0 and counted["preload_hits"] == 0  # no library


def test_another_user_is_served_what_every_user_may_read_and_nothing_else(mount,
                                                                           tmp_path) -> None:
    """On an --allow-other mount another user's opens of files every user may read are hits
    from the cache's files (the public index); a file closed to others, or one in a closed
    directory, is the mount's answer (EACCES), and no such cache file opens for them, even
    by its number; a chmod in the source closes a public one at once."""
    source = tmp_path / "data"
    (source / "closed").mkdir(parents=True)
    source.chmod(0o755)
    (source / "closed").chmod(0o700)
    modes = {"open.bin": 0o644, "private.bin": 0o600, "closed/inside.bin": 0o644}
    for name, mode in modes.items():
        (source / name).write_text(os.urandom(2500).hex())  # text: `cat`'s output is decoded
        (source / name).chmod(mode)
    names = sorted(modes)
    # the mountpoint, the library and `cat` where the other user can reach them, whatever
    # the modes of the checkout and of pytest's directories
    with reachable_by_anyone(Path(str(library()))) as (lib,):
        m = mount(source, "--allow-other", mountpoint=lib.parent / "mnt")
        try:
            preloaded("open", m.mountpoint, names)  # the owner's reads fill all three
            wait_for(lambda: m.status()["shared"]["published"] == 3, "published")
            assert m.status()["shared"]["published_to_all"] == 1
            env = environment([str(m.mountpoint)], {})
            assert env is not None
            variables = [f"LD_PRELOAD={lib}", f"COORDLFS_MOUNTS={env['COORDLFS_MOUNTS']}"]

            def cat(name: str) -> subprocess.CompletedProcess:
                return run_as_other_user(["env", *variables, "cat", m.mountpoint / name])

            before = reads(m)["preload_hits"]
            got = {name: cat(name) for name in names}
            assert reads(m)["preload_hits"] == before + 1  # open.bin, from the cache
            files = Path(m.status()["shared"]["files"])
            numbers = sorted(files.iterdir())
            assert [oct(p.stat().st_mode & 0o777) for p in numbers].count("0o444") == 1
            for entry in numbers:  # no file but the public one opens for them by its number
                direct = run_as_other_user(["cat", entry])
                assert (direct.returncode == 0) == (entry.stat().st_mode & 0o004 != 0)
            (source / "open.bin").chmod(0o600)  # closed in the source: closed in the cache
            wait_for(lambda: all(p.stat().st_mode & 0o777 == 0o600 for p in numbers),
                     "the public file closed")
            again = cat("open.bin")
        finally:
            force_unmount(m.mountpoint, m.pid)
    assert got["open.bin"].returncode == 0, got["open.bin"].stderr
    assert got["open.bin"].stdout == (source / "open.bin").read_text()
    for name in ("private.bin", "closed/inside.bin"):  # what the mount says
        assert got[name].returncode != 0 and "Permission denied" in got[name].stderr
    assert again.returncode != 0 and "Permission denied" in again.stderr


def test_a_killed_daemon_serves_no_hit_after_its_beat_goes_stale(served) -> None:
    m, expected = served
    names = sorted(expected)[:5]
    preloaded("open", m.mountpoint, names)
    wait_for(lambda: m.status()["shared"]["published"] == len(names), "published")
    script = (
        "import os, sys, time, errno\n"
        "path = sys.argv[1]\n"
        "open(path, 'rb').read()\n"  # a hit while the daemon lives
        "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
        "try:\n    open(path, 'rb').read(); print('read')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])\n")
    job = subprocess.Popen([*COORDLFS, "run", "--", sys.executable, "-c", script,
                            str(m.mountpoint / names[0])], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert job.stdout is not None
    assert job.stdout.readline() == "ready\n"
    os.kill(m.pid, signal.SIGKILL)
    time.sleep(2.2)  # the beat's bound: 2 s after the daemon's last moment of life
    out, _ = job.communicate("go\n", timeout=60)
    assert out.strip() == "ENOTCONN"  # what the dead mount gives, not the cache's file
    force_unmount(m.mountpoint, None)


def test_the_exit_status_and_signals_are_the_commands(served) -> None:
    assert run_cli("run", "--", "sh", "-c", "exit 7").returncode == 7
    job = subprocess.Popen([*COORDLFS, "run", "--", "sleep", "30"])
    time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == -signal.SIGTERM  # the command itself took the signal
    missing = run_cli("run", "--", "no-such-command-here")
    assert missing.returncode == 127
    assert missing.stderr.count("\n") == 1 and "no-such-command-here" in missing.stderr


def test_without_the_library_the_command_runs_plainly(served) -> None:
    m, expected = served
    name = sorted(expected)[0]
    env = {**os.environ, "COORDLFS_PRELOAD_LIBRARY": "/nonexistent/lib.so"}
    done = subprocess.run([*COORDLFS, "run", "--", "cat", str(m.mountpoint / name)],
                          capture_output=True, timeout=60, env=env)
    assert done.returncode == 0
    assert xxhash.xxh64_hexdigest(done.stdout) == expected[name]
    assert done.stderr.decode().count("\n") == 1
    assert b"not built" in done.stderr


def test_print_env_names_the_library_and_the_mount(served) -> None:
    m, _expected = served
    out = run_cli("run", "--print-env", "--mount", str(m.mountpoint))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")  # not splitlines: it splits at \x1e too
    assert lines[0] == f"export LD_PRELOAD={LIBRARY}"
    assert lines[1].startswith("export COORDLFS_MOUNTS=") and str(m.mountpoint) in lines[1]
    slurm = run_cli("run", "--print-env", "slurm", "--mount", str(m.mountpoint))
    assert "'" not in slurm.stdout
    bad = run_cli("run", "--mount", str(m.source), "--", "true")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1


def test_the_slurm_task_prolog_prints_export_lines(served) -> None:
    m, _expected = served
    script = Path(__file__).parents[2] / "mount" / "slurm" / "coordlfs-taskprolog"
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    lines = done.stdout.split("\n")  # not splitlines: it splits at \x1e too
    assert lines[0] == f"export LD_PRELOAD={LIBRARY}"
    assert lines[1].startswith("export COORDLFS_MOUNTS=") and str(m.mountpoint) in lines[1]


def test_the_metrics_count_what_the_library_served(mount, tmp_path) -> None:
    source = tmp_path / "data"
    source.mkdir()
    make_dataset(source, 20)
    port = free_port()
    m = mount(source, "--metrics", f"127.0.0.1:{port}")
    names = sorted(digests(source))
    preloaded("open", m.mountpoint, names)
    wait_for(lambda: m.status()["shared"]["published"] == len(names), "every file published")
    preloaded("open", m.mountpoint, names)
    samples = scrape(port)
    reads = m.status()["reads"]
    assert reads["preload_hits"] == reads["preload_misses"] == len(names)
    expected = {
        ("coordlfs_preload_opens_total", "result", "hit"): reads["preload_hits"],
        ("coordlfs_preload_opens_total", "result", "miss"): reads["preload_misses"],
        ("coordlfs_preload_open_bytes_total", "from", "cache"):
            reads["preload_bytes_from_cache"],
        ("coordlfs_preload_open_bytes_total", "from", "storage"):
            reads["preload_bytes_from_source"],
    }
    assert {key: value(samples, key[0], **{key[1]: key[2]}) for key in expected} == expected


def test_fio_reads_under_the_library_whose_constructors_open_files_first(served) -> None:
    """fio loads libselinux, whose constructor calls fopen before the library's own runs."""
    m, expected = served
    if shutil.which("fio") is None:
        pytest.skip("no fio")
    names = sorted(expected)[1:4]
    files = ":".join(str(m.mountpoint / name) for name in names)
    done = subprocess.run([*COORDLFS, "run", "--mount", str(m.mountpoint), "--", "fio",
                           "--name=epoch", "--ioengine=psync", "--rw=read", "--bs=4k",
                           "--readonly", f"--filename={files}", "--verify=0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "READ:" in done.stdout
    assert reads(m)["preload_misses"] == len(names)


def test_cp_copies_a_hit_and_a_miss(served, tmp_path) -> None:
    """cp stats the path, opens it and compares the descriptor's device and inode with its
    stat ("replaced while being copied"): a served descriptor answers what the stat saw."""
    m, expected = served
    names = sorted(expected)[:2]
    preloaded("open", m.mountpoint, names[:1])  # the first a hit, the second a miss
    wait_for(lambda: m.status()["shared"]["published"] == 1, "published")
    out = tmp_path / "copies"
    out.mkdir()
    done = subprocess.run([*COORDLFS, "run", "--mount", str(m.mountpoint), "--", "cp",
                           *(str(m.mountpoint / name) for name in names), str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in names:
        assert xxhash.xxh64_hexdigest((out / Path(name).name).read_bytes()) == expected[name]
    counted = reads(m)
    assert (counted["preload_hits"], counted["preload_misses"]) == (1, 2)


def test_a_forked_child_keeps_its_descriptors(served) -> None:
    """A child forked before the process opened anything on the mount keeps its stdin: the
    library's fork handler closes only its own connection (it closed descriptor 0, the
    unset connection's number, before)."""
    m, _expected = served
    script = ("import os\npid = os.fork()\nif pid == 0:\n"
              "    try:\n        os.fstat(0)\n        os._exit(0)\n"
              "    except OSError:\n        os._exit(3)\n"
              "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    done = subprocess.run([*COORDLFS, "run", "--mount", str(m.mountpoint), "--",
                           sys.executable, "-c", script], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_a_cache_that_served_other_users_is_private_again_without_allow_other(
        mount, tmp_path) -> None:
    """A cache kept from an --allow-other mount (some of its files 0444, its directories
    searchable) mounts again, killed or not, and without --allow-other is private again:
    the mount refused such a directory before ("not a private directory")."""
    source = tmp_path / "data"
    source.mkdir()
    source.chmod(0o755)
    make_dataset(source, 10)
    cache = tmp_path / "cache"
    names = sorted(digests(source))
    m = mount(source, "--allow-other", "--keep-cache", cache_dir=cache)
    preloaded("open", m.mountpoint, names)
    wait_for(lambda: m.status()["shared"]["published_to_all"] == len(names), "public")
    files = cache / "files"
    assert any(p.stat().st_mode & 0o004 for p in files.iterdir())
    os.kill(m.pid, signal.SIGKILL)  # as a killed daemon leaves it
    force_unmount(m.mountpoint, None)
    again = mount(source, "--allow-other", "--keep-cache", cache_dir=cache)
    assert preloaded("open", again.mountpoint, names) == digests(source)
    force_unmount(again.mountpoint, again.pid)
    private = mount(source, "--keep-cache", cache_dir=cache)
    assert private.status()["shared"]["published_to_all"] == 0
    assert files.stat().st_mode & 0o777 == 0o700 and cache.stat().st_mode & 0o077 == 0
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files.iterdir())
