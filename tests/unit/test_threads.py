"""``threads.in_thread``: a blocking call in a worker thread, its result or its error here."""

from __future__ import annotations

import threading

import pytest
import trio

from coordlfs.source.threads import in_thread


def test_the_call_runs_in_another_thread_and_its_result_comes_back() -> None:
    async def body() -> None:
        total, thread = await in_thread(lambda a, b: (a + b, threading.get_ident()), 2, 3)
        assert total == 5 and thread != threading.get_ident()

    trio.run(body)


def test_its_exception_is_raised_in_the_caller() -> None:
    def fails() -> None:
        raise FileNotFoundError(2, "gone")

    async def body() -> None:
        with pytest.raises(FileNotFoundError):
            await in_thread(fails)

    trio.run(body)


def test_a_cancelled_caller_still_waits_for_the_call_and_sees_its_result() -> None:
    done = threading.Event()

    async def body() -> None:
        with trio.CancelScope() as scope:
            scope.cancel()
            assert await in_thread(done.wait, 5) is True
        assert done.is_set()

    def release() -> None:
        done.set()

    threading.Timer(0.05, release).start()
    trio.run(body)
