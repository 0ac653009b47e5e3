"""The option table (coordlfs.daemon.options): flags and -o mean the same, errors are one line, the
config reaches the daemon whole, and the README lists exactly the table's options."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from coordlfs.cli import build_parser
from coordlfs.daemon.config import DEFAULT_MAX_FILE_SHARE, MountConfig
from coordlfs.daemon.options import OPTIONS, given, parse, parse_mount_options, resolve
from coordlfs.errors import UserError
from coordlfs.peers import placement

ROOT = Path(__file__).resolve().parents[2]


def options_of(*argv: str) -> dict:
    """The parsed values of ``coordlfs mount /src /mnt ARGV``."""
    args = build_parser().parse_args(["mount", "/src", "/mnt", *argv])
    return parse(given(args, args.sloppy))


def test_mount_options_mean_their_flags() -> None:
    """Moved from the helper's test: cluster options in -o (peers joined by '+') are the
    flags."""
    from_o = options_of("-o", "listen=0.0.0.0:7878,peers=h1:7878+h2:7878,secret_file=/etc/s,"
                              "peer_timeout=1,insecure")
    from_flags = options_of("--listen", "0.0.0.0:7878", "--peers", "h1:7878,h2:7878",
                            "--secret-file", "/etc/s", "--peer-timeout", "1", "--insecure")
    assert from_o == from_flags == {"listen": "0.0.0.0:7878", "peers": ("h1:7878", "h2:7878"),
                                    "secret_file": "/etc/s", "peer_timeout": 1.0,
                                    "insecure": True}


SAMPLES = {"listen": "127.0.0.1:7", "peers": "127.0.0.1:7+127.0.0.1:8", "cache_tmpfs": "no",
           "passthrough": "no", "request_lane": "no", "peers_from": "dns:peers.example:7878",
           "metrics": "127.0.0.1:9", "cache_size": "7M"}


def test_every_mount_option_has_its_flag() -> None:
    for option in OPTIONS:
        if not option.in_mount_options:
            continue
        text = SAMPLES.get(option.name, "7") if option.parse else None
        item = option.name if text is None else f"{option.name}={text}"
        flag = [option.flag] if text is None else [option.flag, text.replace("+", ",")]
        assert options_of("-o", item) == options_of(*flag), option.name


def test_later_values_and_flags_win() -> None:
    assert options_of("-o", "cache_size=1M,cache_size=2M") == {"cache_size": 2 << 20}
    assert options_of("-o", "cache_size=1M", "-o", "cache_size=3M") == {"cache_size": 3 << 20}
    assert options_of("-o", "cache_size=1M", "--cache-size", "4M") == {"cache_size": 4 << 20}


def test_generic_mount_options_are_ignored() -> None:
    assert parse_mount_options(["defaults,ro,noauto,nofail,_netdev,nosuid,nodev,,user",
                                "x-systemd.requires-mounts-for=/data,comment=x,debug"]) == {
        "debug": True}


@pytest.mark.parametrize(("argv", "says"), [
    (["-o", "bogus=1"], "unknown option 'bogus=1' (known: cache_size=SIZE,"),
    (["-o", "foreground"], "unknown option 'foreground'"),
    (["-o", "cache_size"], "option cache_size needs a value (cache_size=SIZE)"),
    (["-o", "cache_size="], "option cache_size needs a value"),
    (["-o", "keep_cache=yes"], "option keep_cache takes no value"),
    (["-o", "cache_size=8Q"], "bad --cache-size '8Q'"),
    (["--cache-size=-1G"], "bad --cache-size"),
    (["--cache-size", "1K"], "bad --cache-size 1K: at least 4K, one page (or 0"),
    (["-o", "cache_size=4095"], "bad --cache-size 4095: at least 4K"),
    (["-o", "staging_size=0"], "bad --staging-size 0: must be more than 0"),
    (["--prefetch-depth", "65"], "bad --prefetch-depth 65: 0 to 64"),
    (["--prefetch-depth", "two"], "bad --prefetch-depth 'two'"),
    (["--revalidate", "0"], "bad --revalidate 0: 0.1 to 3600 seconds"),
    (["-o", "peer_timeout=61"], "bad --peer-timeout 61: more than 0, at most 60 s"),
    (["--peer-timeout", "0"], "bad --peer-timeout 0"),
    (["--listen", "localhost"], "expected HOST:PORT"),
    (["--cache-dir", ""], "--cache-dir needs a path"),
    (["-o", "peers=127.0.0.1:1+127.0.0.1:1"], "--peers names a node twice"),
])
def test_bad_options_are_one_line_errors(argv: list[str], says: str) -> None:
    with pytest.raises(UserError) as error:
        options_of(*argv)
    assert says in str(error.value)
    assert "\n" not in str(error.value)


def test_sloppy_skips_unknown_options() -> None:
    assert options_of("--sloppy", "-o", "bogus=1,cache_size=1M") == {"cache_size": 1 << 20}


def test_defaults_and_the_config(tmp_path: Path) -> None:
    config = resolve(options_of("-o", "cache_size=8M,cache_dir=cache", "-f"),
                     str(tmp_path), str(tmp_path))
    assert config.cache_size == 8 << 20
    assert config.max_file_size == int((8 << 20) * DEFAULT_MAX_FILE_SHARE)
    assert config.cache_dir == str(Path.cwd() / "cache")
    assert config.log_file is None  # foreground: stderr
    for option in OPTIONS:  # the rest: the table's defaults (settled ones have tests below)
        if option.in_mount_options and not callable(option.default) and option.settle is None:
            assert getattr(config, option.field or option.name) == option.default, option.name
    detached = resolve(options_of("--log", "x.log"), str(tmp_path), str(tmp_path))
    assert detached.log_file == str(Path.cwd() / "x.log")


def test_no_cache_and_a_file_limit_above_the_cache_are_warned_about(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0 turns the cache off (what the aligned-group tests mount with), said on stderr; a
    --max-file-size above the cache is lowered to it, with a warning that names both."""
    def config(*argv: str) -> tuple[MountConfig, str]:
        settled = resolve(options_of("-f", "--cache-dir", str(tmp_path / "cache"), *argv),
                          str(tmp_path / "src"), str(tmp_path / "mnt"))
        return settled, capsys.readouterr().err
    off, said = config("--cache-size", "0", "--max-file-size", "1G")
    assert (off.cache_size, off.max_file_size) == (0, 0)
    assert said == "coordlfs: warning: --cache-size 0: no cache, every read goes to the source\n"
    lowered, said = config("--cache-size", "8M", "--max-file-size", "1G")
    assert lowered.max_file_size == 8 << 20
    assert said == ("coordlfs: warning: --max-file-size 1.0 GiB is more than the cache (8.0 MiB):"
                    " files above the cache size can never be cached; using 8.0 MiB\n")
    assert config("--cache-size", "8M", "--max-file-size", "8M")[0].max_file_size == 8 << 20
    assert config("--cache-size", "1M")[1] == ""  # one read
    small, said = config("--cache-size", "1023K")
    assert small.cache_size == 1023 << 10
    assert said == ("coordlfs: warning: --cache-size 1023.0 KiB holds less than one read (1M): "
                    "only smaller files are cached\n")


def test_a_cache_directory_without_room_for_the_smallest_cache_is_refused(
        tmp_path: Path) -> None:
    """/proc has no free space at all: the cache would be shrunk to 0 B (it was, silently)."""
    with pytest.raises(UserError) as error:
        resolve(options_of("-f", "--cache-dir", "/proc/coordlfs-none/cache"), str(tmp_path),
                str(tmp_path))
    assert str(error.value) == ("only 0 B free for /proc/coordlfs-none/cache (less a margin), "
                                "less than the smallest cache (4K); give --cache-dir on a "
                                "filesystem with room")


def test_the_default_log_file_needs_a_home(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative state directory (no HOME to expand) would put the log wherever the command
    ran: one line instead."""
    monkeypatch.setenv("XDG_STATE_HOME", "state")
    with pytest.raises(UserError, match=re.escape("no directory for the default log file "
                                                  "(state); give --log FILE")):
        resolve(options_of("--cache-size", "1M", "--cache-dir", str(tmp_path / "cache")),
                str(tmp_path), str(tmp_path / "mnt"))


def test_the_cache_gets_a_tmpfs_of_its_own_as_root_in_its_default_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def tmpfs(*argv: str, root: bool = True) -> bool:
        monkeypatch.setattr(os, "geteuid", lambda: 0 if root else 1000)
        return resolve(options_of("-o", "cache_size=8M", *argv), str(tmp_path / "src"),
                       str(tmp_path / "mnt")).cache_tmpfs
    assert tmpfs() and not tmpfs(root=False)
    assert not tmpfs("--cache-dir", str(tmp_path / "mine"))  # a directory named is used as is
    assert tmpfs("--cache-dir", str(tmp_path / "mine"), "--cache-tmpfs", "yes")
    assert not tmpfs("-o", "cache_tmpfs=no")
    with pytest.raises(UserError, match="bad --cache-tmpfs 'maybe': yes, no or auto"):
        tmpfs("--cache-tmpfs", "maybe")


def test_the_config_reaches_the_daemon_whole(tmp_path: Path) -> None:
    config = resolve(options_of("-o", "listen=127.0.0.1:1,peers=127.0.0.1:1+127.0.0.1:2,"
                                      "insecure,revalidate=0.5,cache_size=1M"),
                     str(tmp_path), str(tmp_path))
    assert MountConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize(("argv", "says"), [
    (["--peers", "127.0.0.1:7001"], "--peers needs --listen"),
    (["--insecure"], "go with --listen"),
    (["--listen", "127.0.0.1:7001"], "--secret-file"),
    (["--listen", "0.0.0.0:7001", "--insecure"], "loopback addresses only"),
    (["--listen", "127.0.0.1:7001", "--insecure", "--secret-file", "/s"], "not both"),
    (["-o", "listen=127.0.0.1:7001,insecure,peers=127.0.0.1:7001+localhost:7001"],
     "names this node twice"),
    (["--listen", "127.0.0.1:7001", "--insecure", "--peers", "127.0.0.1:7001", "--peers-file",
      "/nodes"], "give one of --peers, --peers-file"),
    (["--peers-from", "slurm"], "--peers-from needs --listen"),
])
def test_cluster_options_are_checked_together(tmp_path: Path, argv: list[str],
                                              says: str) -> None:
    with pytest.raises(UserError, match=re.escape(says)):
        resolve(options_of(*argv), str(tmp_path), str(tmp_path))


def test_a_name_getaddrinfo_cannot_take_is_one_line() -> None:
    """An empty label makes getaddrinfo raise UnicodeError, not OSError: it was a traceback."""
    with pytest.raises(UserError, match=re.escape("cannot resolve peer a..b:7001")):
        placement.resolve(placement.parse_address("a..b:7001", "--peers"))


def test_help_lists_every_option_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["mount", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in OPTIONS:
        assert option.flag in text
        assert f"(default {option.stated_default()})" in text or not option.stated_default()
    assert "--fake" not in text and "--sloppy" not in text and "--ready-fd" not in text


def readme_rows(path: Path, heading: str) -> dict[str, tuple[str, str]]:
    """The option table after ``heading``: flag -> (spelling in -o, meaning), backticks off."""
    text = path.read_text()
    rows = {}
    for line in text[text.index(heading):].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        if not line.startswith("| `"):
            continue
        cells = line.strip("|").split("|")
        names, in_o, meaning = (cell.strip().replace("`", "") for cell in cells)
        for name in names.split(", "):
            rows[name.split()[0]] = (in_o, meaning)
    return rows


def test_readme_option_table_is_the_table() -> None:
    rows = readme_rows(ROOT / "README.md", "`coordlfs mount SOURCE MOUNTPOINT` options")
    flags = {"-o", *(option.flag for option in OPTIONS), *(o.short for o in OPTIONS if o.short)}
    assert set(rows) == flags
    assert [flag for flag in rows if flag.startswith("--")] == [o.flag for o in OPTIONS]
    for option in OPTIONS:
        in_o, meaning = rows[option.flag]
        assert in_o == (option.mount_option if option.in_mount_options else ""), option.name
        default = option.stated_default()
        if default:
            assert re.search(rf"default {re.escape(default)}(?![\w.])", meaning), option.name
