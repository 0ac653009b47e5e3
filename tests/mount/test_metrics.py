"""``--metrics HOST:PORT`` on a real mount: scraped over HTTP and parsed as Prometheus text,
the series equal what ``coordlfs stats`` shows; a taken port or a bad address is a one-line
error and no mount; the server goes away with the daemon; and the Grafana dashboard in
``mount/grafana`` is valid and asks only for series the exporter emits."""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from conftest import drop_caches, force_unmount, run_cli

from coordlfs import __version__
from coordlfs.client.dataset import Dataset
from coordlfs.control import Control
from coordlfs.protocol import spec
from coordlfs.system.processes import process_alive, wait_exit
from coordlfs.testbed.scrape import scrape, scrape_text, series_names, value

DASHBOARD = Path(__file__).parents[2] / "mount" / "grafana" / "coordlfs.json"
#: Series a PromQL expression names (the exporter's and prometheus_client's process ones).
SERIES = re.compile(r"\b(?:coordlfs|process)_[a-z_]+\b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stats_json(mountpoint: Path) -> dict[str, Any]:
    result = run_cli("stats", str(mountpoint), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_series_are_the_stats_counters(mount, dataset) -> None:
    source, sizes = dataset
    port = free_port()
    m = mount(source, "--cache-size", "1G", "--metrics", f"127.0.0.1:{port}")
    names = sorted(sizes)
    for name in names:  # misses: from storage into the cache
        (m.mountpoint / name).read_bytes()
    drop_caches()
    for name in names[:50]:  # hits, served by the daemon
        (m.mountpoint / name).read_bytes()
    with Dataset(m.mountpoint) as ds:  # hits from shared memory, reported as it closes
        for name in names[50:80]:
            assert len(ds.read(name)) == sizes[name]
    samples = scrape(port)
    status = stats_json(m.mountpoint)  # nothing read in between: the same counters
    reads, cache = status["reads"], status["cache"]
    expected = {
        ("coordlfs_read_bytes_total", "from", "cache"): reads["bytes_from_cache"],
        ("coordlfs_read_bytes_total", "from", "peers"): reads["bytes_from_peers"],
        ("coordlfs_read_bytes_total", "from", "storage"): reads["bytes_from_source"],
        ("coordlfs_read_files_total", "from", "cache"): reads["file_hits"],
        ("coordlfs_read_files_total", "from", "peers"): reads["file_peer_hits"],
        ("coordlfs_read_files_total", "from", "storage"): reads["file_misses"],
        ("coordlfs_read_requests_total", "result", "hit"): reads["read_hits"],
        ("coordlfs_read_requests_total", "result", "miss"): reads["read_misses"],
        ("coordlfs_client_reads_total", "result", "hit"): reads["client_hits"],
        ("coordlfs_client_reads_total", "result", "miss"): reads["client_misses"],
        ("coordlfs_client_read_bytes_total", "from", "cache"): reads["client_bytes_from_cache"],
    }
    assert {key: value(samples, key[0], **{key[1]: key[2]}) for key in expected} == expected
    assert reads["bytes_from_source"] == sum(sizes.values()) and reads["file_misses"] == 200
    assert reads["bytes_from_cache"] > 0 and reads["client_hits"] == 30
    assert reads["file_hits"] == 50 + 30  # an open each: the mount's and the client's
    for name, key in (("coordlfs_cache_used_bytes", "used_bytes"),
                      ("coordlfs_cache_capacity_bytes", "capacity_bytes"),
                      ("coordlfs_cache_files", "files")):
        assert value(samples, name) == cache[key], name
    assert value(samples, "coordlfs_cache_files") == 200
    assert value(samples, "coordlfs_fill_queued_files") == status["fills"]["queued"]
    assert value(samples, "coordlfs_inodes") == status["inodes"]
    assert value(samples, "coordlfs_peer_nodes") == 0
    info = value(samples, "coordlfs_info", version=__version__, protocol=str(status["protocol"]),
                 source=str(source), mountpoint=str(m.mountpoint), node="",
                 peers_from=status["peers"]["source"],
                 passthrough_off=status["passthrough"]["why_off"] or "")
    assert info == 1
    assert value(samples, "process_open_fds") > 0  # the daemon's own, not this process's


def test_a_taken_port_or_a_bad_address_is_a_one_line_error(dataset, tmp_path: Path) -> None:
    source, _ = dataset
    mountpoint, cache = tmp_path / "mnt", tmp_path / "cache"
    mountpoint.mkdir()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [
        (f"127.0.0.1:{busy.getsockname()[1]}", "cannot serve metrics on 127.0.0.1:"),
        ("192.0.2.1:9100", "cannot serve metrics on 192.0.2.1:9100"),  # not this host's
        ("no-such-host.invalid:9100", "cannot resolve --metrics no-such-host.invalid:9100"),
        ("127.0.0.1", "bad --metrics"),
    ]
    try:
        for address, message in cases:
            result = run_cli("mount", str(source), str(mountpoint), "--cache-size", "16M",
                             "--cache-dir", str(cache), "--metrics", address)
            if result.returncode == 0:  # it should not have: take it down before failing
                force_unmount(mountpoint, None)
            assert result.returncode != 0, address
            assert message in result.stderr, (address, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert "Traceback" not in result.stderr
            assert not os.path.ismount(mountpoint)
            assert not cache.exists()  # the daemon that could not bind removed it
    finally:
        busy.close()


def test_scrapes_go_on_while_reading_and_the_server_leaves_with_the_daemon(mount,
                                                                           dataset) -> None:
    source, sizes = dataset
    port = free_port()
    m = mount(source, "--cache-size", "1G", "--metrics", f"127.0.0.1:{port}")
    names = sorted(sizes)
    seen = []
    for start in range(0, len(names), 40):
        for name in names[start:start + 40]:
            (m.mountpoint / name).read_bytes()
        seen.append(value(scrape(port), "coordlfs_read_files_total", **{"from": "storage"}))
    assert seen == sorted(seen) and seen[-1] == len(names)  # counters only grow
    assert run_cli("umount", str(m.mountpoint)).returncode == 0
    assert wait_exit(m.pid, 0) and not process_alive(m.pid)  # no thread kept it alive
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    with socket.socket() as s:  # nothing listens there (the scrapes' TIME_WAIT may linger)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


# -- the Grafana dashboard ----------------------------------------------------------------


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_the_dashboard_is_valid_json_on_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${datasource}"}
    assert variables["instance"]["datasource"] == source
    panels = dashboard_panels()
    titles = {p["title"] for p in panels}
    assert {"Read rate by source", "Hit ratio", "Cache fill", "Peer links by state",
            "Peer traffic", "Prep groups", "Aligned groups", "Fill queue"} <= titles
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source and SERIES.search(target["expr"])


def test_every_series_the_dashboard_asks_for_is_emitted(mount, dataset) -> None:
    """A mount with a peer (one that is not there), an aligned group and a prep group in an
    epoch: the series of every panel, the per-peer and per-group ones too."""
    source, sizes = dataset
    port, listen, absent = free_port(), free_port(), free_port()
    m = mount(source, "--cache-size", "1G", "--metrics", f"127.0.0.1:{port}", "--insecure",
              "--listen", f"127.0.0.1:{listen}", "--peers",
              f"127.0.0.1:{listen},127.0.0.1:{absent}")
    for name in sorted(sizes)[:20]:
        (m.mountpoint / name).read_bytes()
    control = Control(m.mountpoint)
    aligned = control.call(spec.GROUP_JOIN, pid=os.getpid(), group="aligned", job="a")
    prep = control.call(spec.PREP_JOIN, pid=os.getpid(), group="prep", job="p", samples=100,
                        batch_size=10)
    try:
        assert control.call(spec.PREP_EPOCH, member=prep["member"], timeout_s=5)["epoch"] == 0
        emitted = series_names(scrape_text(port))
    finally:
        control.call(spec.PREP_LEAVE, member=prep["member"])
        control.call(spec.GROUP_LEAVE, member=aligned["member"])
    asked = {name for panel in dashboard_panels() for target in panel["targets"]
             for name in SERIES.findall(target["expr"])}
    assert asked - emitted == set()
    assert {"coordlfs_peer_state", "coordlfs_served_bytes_total", "coordlfs_group_members",
            "coordlfs_prep_group_staged_batches", "coordlfs_served_in_c_files_total"} <= emitted
