"""coordlfs.system.private_dir: a directory of ours is made 0700, or used only when nobody else can
change it or what leads to it; a refusal is one line naming the directory at fault."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordlfs.errors import UserError
from coordlfs.system.private_dir import open_private

REMEDY = "remove it"
OTHER_UID = 65534


@pytest.fixture
def opened() -> Iterator:
    """``open_private``, its descriptors closed after the test."""
    fds: list[int] = []

    def _open(path: Path) -> tuple[str, int]:
        found = open_private(str(path), REMEDY)
        fds.append(found.fd)
        return found

    yield _open
    for fd in fds:
        os.close(fd)


def refusal(path: Path) -> str:
    with pytest.raises(UserError) as refused:
        open_private(str(path), REMEDY)
    message = str(refused.value)
    assert "\n" not in message and message.endswith(f": {REMEDY}"), message
    return message


def test_missing_directories_are_made_private_and_the_last_is_opened(tmp_path: Path,
                                                                     opened) -> None:
    path, fd = opened(tmp_path / "a" / "b")
    assert path == str(tmp_path / "a" / "b")
    assert os.fstat(fd).st_ino == os.stat(path).st_ino
    assert [p.stat().st_mode & 0o777 for p in (tmp_path / "a", tmp_path / "a" / "b")] == [
        0o700, 0o700]
    os.mkdir("made", dir_fd=fd)  # what callers do: everything relative to the descriptor
    assert (tmp_path / "a" / "b" / "made").is_dir()


def test_an_existing_directory_of_ours_is_used_as_it_is(tmp_path: Path, opened) -> None:
    (tmp_path / "mine").mkdir(mode=0o755)
    (tmp_path / "mine" / "kept").write_bytes(b"x")
    fd = opened(tmp_path / "mine").fd
    assert os.listdir(fd) == ["kept"] and (tmp_path / "mine").stat().st_mode & 0o777 == 0o755


def test_a_link_or_a_file_in_its_place_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert refusal(tmp_path / "link") == f"{tmp_path}/link is a symbolic link: {REMEDY}"
    (tmp_path / "file").write_bytes(b"")
    assert refusal(tmp_path / "file") == f"{tmp_path}/file is not a directory: {REMEDY}"
    assert refusal(tmp_path / "file" / "below").startswith(f"{tmp_path}/file is not a dir")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_directory_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(mode)
    assert refusal(tmp_path / "open") == (
        f"{tmp_path}/open is writable by others (mode {mode:04o}): {REMEDY}")


def test_an_ancestor_others_may_write_is_refused_unless_sticky(tmp_path: Path,
                                                               opened) -> None:
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o777)
    assert refusal(tmp_path / "shared" / "ours") == (
        f"{tmp_path}/shared is writable by others and not sticky (mode 0777): {REMEDY}")
    assert not (tmp_path / "shared" / "ours").exists()  # refused before making anything
    (tmp_path / "shared").chmod(0o1777)  # like /tmp and /dev/shm: nobody renames ours
    assert opened(tmp_path / "shared" / "ours").path == str(tmp_path / "shared" / "ours")


def test_a_link_among_the_ancestors_is_followed_when_ours(tmp_path: Path, opened) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to("real")  # relative, as /var/run -> ../run
    assert opened(tmp_path / "via" / "cache").path == str(tmp_path / "real" / "cache")
    (tmp_path / "loop").symlink_to("loop")
    assert "symbolic links" in refusal(tmp_path / "loop" / "cache")


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user: needs root")
def test_what_another_user_owns_is_refused(tmp_path: Path) -> None:
    (tmp_path / "theirs").mkdir(mode=0o700)
    os.chown(tmp_path / "theirs", OTHER_UID, OTHER_UID)
    assert refusal(tmp_path / "theirs") == (
        f"{tmp_path}/theirs is owned by uid {OTHER_UID}, not 0: {REMEDY}")
    assert refusal(tmp_path / "theirs" / "ours").startswith(
        f"{tmp_path}/theirs is owned by uid {OTHER_UID}")
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to("real")
    os.lchown(tmp_path / "via", OTHER_UID, OTHER_UID)
    assert refusal(tmp_path / "via" / "ours") == (
        f"{tmp_path}/via is a symbolic link owned by uid {OTHER_UID}: {REMEDY}")
