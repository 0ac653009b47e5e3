"""The control commands' one declaration (coordlfs.protocol.spec) drives the daemon's handlers,
`help`, the client and the docs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordlfs.cache.fills import FillQueue
from coordlfs.cache.fills import register_commands as register_fill_commands
from coordlfs.cache.held import register_commands as register_held_commands
from coordlfs.cache.publishing import register_commands as register_share_command
from coordlfs.cache.stats import Stats
from coordlfs.cache.stats import register_commands as register_stats_commands
from coordlfs.control import Control
from coordlfs.jobs.groups import Groups
from coordlfs.jobs.groups import register_commands as register_group_commands
from coordlfs.jobs.prep import Prep
from coordlfs.jobs.prep import register_commands as register_prep_commands
from coordlfs.peers.server import register_commands as register_peer_commands
from coordlfs.peers.warm import WarmRelays
from coordlfs.peers.warm import register_commands as register_warm_commands
from coordlfs.protocol import spec as control_spec
from coordlfs.protocol.server import ControlServer
from coordlfs.protocol.spec import COMMANDS, doc_table
from coordlfs.source.source import Source

PROTOCOL_DOC = Path(__file__).resolve().parents[2] / "docs" / "design" / "control-protocol.md"


def _daemon_server(tmp_path: Path) -> ControlServer:
    """A control server with every capability's commands, as the daemon assembles it."""
    server = ControlServer(lambda: {})
    register_stats_commands(server, Stats())
    register_group_commands(server, Groups())
    register_prep_commands(server, Prep(1 << 20, root=str(tmp_path)))
    register_peer_commands(server, None, None)  # type: ignore[arg-type]
    source = Source(str(tmp_path))
    fills = FillQueue(None, source, 0)  # type: ignore[arg-type]
    register_fill_commands(server, fills, source)
    register_warm_commands(server, fills, WarmRelays(None))  # type: ignore[arg-type]
    register_held_commands(server, None, source)  # type: ignore[arg-type]
    register_share_command(server, SimpleNamespace(caught_up=[]))  # type: ignore[arg-type]
    return server


def test_every_declared_command_is_served_and_helped(tmp_path: Path) -> None:
    reply = json.loads(_daemon_server(tmp_path).handle(b'{"cmd": "help"}')[0])
    assert sorted(reply["commands"]) == sorted(COMMANDS)
    for name, command in COMMANDS.items():
        assert reply["access"][name] == command.access.value
        assert reply["arguments"][name] == [a.doc() for a in command.args]


def test_a_handler_needs_a_declaration() -> None:
    with pytest.raises(KeyError):
        ControlServer(lambda: {}).serve("group.joni", lambda _a, _c: {})


def test_the_client_sends_only_declared_arguments() -> None:
    control = Control("/nonexistent")
    with pytest.raises(ValueError, match=r"group\.leave takes"):
        control.call(control_spec.GROUP_LEAVE, membr=1)
    with pytest.raises(ValueError, match=r"group\.leave takes"):
        control.call(control_spec.GROUP_LEAVE)


def test_the_docs_table_is_the_declaration() -> None:
    """docs/design/control-protocol.md's command table is ``doc_table()``, verbatim: a command or
    argument added, renamed or re-levelled shows there."""
    assert doc_table() in PROTOCOL_DOC.read_text()
