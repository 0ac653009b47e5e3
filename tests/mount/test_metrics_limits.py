"""``--metrics`` under connections nobody should hold, on real mounts over real TCP: a crowd of
idle connections from another user cannot take the descriptors the mount's readers need, a
scrape past the cap is answered (the oldest idle connection closed for it), one that sends
nothing or trickles its request is closed after the timeout, an oversized request is
refused, and scrapes work again once the crowd is gone.

Each of these failed before: 300 idle connections from uid 65534 took every descriptor of a
daemon limited to 256 and uncached reads through the mount failed with EMFILE, an idle or
trickling connection was held for as long as its sender liked, and while 16 idle connections
were held every scrape was answered 503.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
import urllib.error
from pathlib import Path

from conftest import OTHER_UID
from test_metrics import free_port

from coordlfs.daemon.metrics import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS, MAX_REQUEST_BYTES
from coordlfs.peers.server import LOG_INTERVAL_S
from coordlfs.testbed.scrape import Samples, scrape, value

#: The daemon's descriptors, soft and hard (it raises the soft limit to the hard one).
DESCRIPTORS = 256
LIMITED = ("prlimit", f"--nofile={DESCRIPTORS}:{DESCRIPTORS}", "--")
#: Idle connections the other user opens: more than the daemon has descriptors, few enough
#: that a daemon without a cap still accepts or queues each (its listen backlog is 128), so
#: the crowd is in place either way.
CROWD = 300
#: The crowd, as a shell every user can run (no checkout or virtualenv path it may not
#: enter): opens ``$2`` connections to port ``$1``, says so, and holds them until its stdin
#: closes.
CROWD_SCRIPT = """
for ((i = 0; i < $2; i++)); do exec {fd}<>"/dev/tcp/127.0.0.1/$1" || exit 1; done
echo open
read -r _ || true
"""
#: Slack for the server's check of its connections (every 0.5 s) and a loaded machine.
SLACK_S = 3.0


def metrics_lines(log: Path, words: str) -> list[str]:
    return [line for line in log.read_text().splitlines()
            if "coordlfs.daemon.metrics:" in line and words in line]


def scrape_when_free(port: int) -> Samples:
    """A scrape, retried while the server still counts connections that just closed: it
    answers 503 (or resets the connection, if it closes it with the request unread)."""
    deadline = time.monotonic() + CONNECTION_TIMEOUT_S + SLACK_S
    while True:
        try:
            return scrape(port)
        except (urllib.error.URLError, ConnectionError) as e:
            busy = e.code == 503 if isinstance(e, urllib.error.HTTPError) else isinstance(
                getattr(e, "reason", e), ConnectionError)
            if not busy or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def test_a_crowd_of_idle_connections_from_another_user_leaves_reads_working(mount,
                                                                          dataset) -> None:
    source, sizes = dataset
    port = free_port()
    m = mount(source, "--cache-size", "1G", "--metrics", f"127.0.0.1:{port}", enter=LIMITED)
    names = sorted(sizes)[:40]  # none cached yet: each read opens its source file
    crowd = subprocess.Popen(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
         "bash", "-c", CROWD_SCRIPT, "crowd", str(port), str(CROWD)],
        cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert crowd.stdout is not None and crowd.stdout.readline() == "open\n"
        started = time.monotonic()
        seen = {name: (m.mountpoint / name).read_bytes() for name in names}
        assert all(seen[name] == (source / name).read_bytes() for name in names)
        assert m.status()["reads"]["file_misses"] == len(names)  # the mount is up
        held = len(os.listdir(f"/proc/{m.pid}/fd"))  # the cap's few, not the crowd's 300
        assert held < DESCRIPTORS // 2, held
    finally:
        crowd.communicate(timeout=30)  # stdin closed: it exits, closing every connection
    assert crowd.returncode == 0
    # every connection past the cap made room or was turned away: a few lines say so, not 284
    turned = metrics_lines(m.log, "turned away") + metrics_lines(m.log, "for a newer one")
    assert 1 <= len(turned) <= 2 + (time.monotonic() - started) / LOG_INTERVAL_S, turned
    samples = scrape_when_free(port)
    assert value(samples, "coordlfs_read_files_total", **{"from": "storage"}) == len(names)


def closed_after(sock: socket.socket, started: float, trickle: bytes = b"") -> tuple[float, int]:
    """Send ``trickle`` a byte every 0.5 s (nothing if empty) until the server hangs up:
    (seconds from ``started``, before the connection, until then; bytes sent by then)."""
    sent = 0
    sock.settimeout(0.5)
    while time.monotonic() < started + 3 * CONNECTION_TIMEOUT_S:
        try:
            if sock.recv(1 << 16) == b"":
                break
        except TimeoutError:
            pass
        except ConnectionResetError:
            break
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
    return time.monotonic() - started, sent


def test_connections_are_capped_timed_out_and_bounded(mount, dataset) -> None:
    source, _sizes = dataset
    port = free_port()
    m = mount(source, "--cache-size", "64M", "--metrics", f"127.0.0.1:{port}")
    # one connection trickles a request (it would take 40 s), the rest of the cap send nothing
    request = b"GET /metrics HTTP/1.0\r\n" + b"X-Slow: " + b"s" * 40 + b"\r\n\r\n"
    started = time.monotonic()
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
    results: list[tuple[float, int]] = [(0.0, 0)] * len(held)

    def watch(i: int) -> None:
        results[i] = closed_after(held[i], started, request if i == 0 else b"")

    watchers = [threading.Thread(target=watch, args=(i,)) for i in range(len(held))]
    for watcher in watchers:
        watcher.start()
    try:
        # a scrape past the cap is answered: the oldest connection not answered yet (the
        # trickling one) is closed to make room for it
        time.sleep(1)  # every one accepted
        assert value(scrape(port), "coordlfs_inodes") >= 1
        scraped = time.monotonic() - started
    finally:
        for watcher in watchers:
            watcher.join()
        for sock in held:
            sock.close()
    (slow_s, sent), *idle = results
    assert sent < len(request) and slow_s < scraped + SLACK_S, (slow_s, sent, scraped)
    # each accepted after ``started``: none closed before its time, each soon after it
    assert all(CONNECTION_TIMEOUT_S <= s < CONNECTION_TIMEOUT_S + SLACK_S for s, _ in idle), idle

    # a request of more than MAX_REQUEST_BYTES is closed unanswered
    big = b"GET /metrics HTTP/1.0\r\n" + (b"X-Pad: " + b"p" * 1000 + b"\r\n") * (
        2 * MAX_REQUEST_BYTES // 1000) + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        reply = b""
        try:
            sock.sendall(big)
            while chunk := sock.recv(1 << 16):
                reply += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert not reply.startswith(b"HTTP/1.0 200"), reply[:200]

    assert value(scrape_when_free(port), "coordlfs_inodes") >= 1  # and scrapes work again
    log = m.log.read_text()
    assert "Traceback" not in log
    assert len(re.findall(r"coordlfs\.metrics:.*(turned away|closed)", log)) <= 4, log
