"""``metrics.Snapshots``: a scrape's thread gets the status taken on a real trio loop, and
neither a loop that cannot answer nor a status that fails holds the thread or harms the loop."""

from __future__ import annotations

import threading
from typing import Any

import trio

from coordlfs.daemon.metrics import NoSnapshot, Snapshots


def _outcome(snapshots: Snapshots) -> Any:
    try:
        return snapshots.take()
    except Exception as e:  # the test looks at what the scrape's thread got
        return e


def test_the_status_is_taken_on_the_loop_thread() -> None:
    loop_thread = threading.get_ident()
    snapshots = Snapshots(lambda: {"thread": threading.get_ident()})

    async def body() -> None:
        snapshots.token = trio.lowlevel.current_trio_token()
        status = await trio.to_thread.run_sync(snapshots.take)
        assert status == {"thread": loop_thread}

    trio.run(body)


def test_a_loop_that_does_not_answer_in_time_fails_the_scrape_not_the_loop() -> None:
    snapshots = Snapshots(lambda: {"late": True}, timeout=0.2)
    got: list[Any] = []

    async def body() -> None:
        snapshots.token = trio.lowlevel.current_trio_token()
        scrape = threading.Thread(target=lambda: got.append(_outcome(snapshots)))
        scrape.start()
        scrape.join()  # holds the loop: it cannot take the status before the scrape gives up
        await trio.sleep(0)  # the late request runs now, with nobody waiting for it

    trio.run(body)
    assert isinstance(got[0], NoSnapshot) and "0.2 s" in str(got[0])


def test_a_failing_status_is_raised_in_the_scrape_and_the_loop_goes_on() -> None:
    def broken() -> dict[str, Any]:
        raise KeyError("gone")

    snapshots = Snapshots(broken)

    async def body() -> None:
        snapshots.token = trio.lowlevel.current_trio_token()
        assert isinstance(await trio.to_thread.run_sync(_outcome, snapshots), KeyError)
        await trio.sleep(0)

    trio.run(body)


def test_before_the_loop_runs_and_after_it_ended_there_is_no_snapshot() -> None:
    snapshots = Snapshots(dict)
    assert isinstance(_outcome(snapshots), NoSnapshot)

    async def body() -> None:
        snapshots.token = trio.lowlevel.current_trio_token()

    trio.run(body)
    assert isinstance(_outcome(snapshots), NoSnapshot)
