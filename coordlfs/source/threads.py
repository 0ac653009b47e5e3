"""One blocking call in a worker thread, with the fewest steps trio allows.

A miss hands its storage read to a thread once per file, so the hand-off is on the per-file
path: ``trio.to_thread.run_sync`` costs 43 µs of CPU a call here (a capacity limiter's lock,
a copied context, the thread renamed for each job), this 28 µs. Like ``to_thread`` without
``abandon_on_cancel``, a call cannot be cancelled: it always runs to its end and its caller
sees the result. The threads come from trio's cache of idle ones; how many run at once is
bounded by the callers (a FUSE request or a fill each waits for its one call), as the
default limiter of 40 bounded them before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

T = TypeVar("T")


def _not_abortable(_raise_cancel: object) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


async def in_thread(call: Callable[..., T], *args: object) -> T:
    """``call(*args)`` in a worker thread; its result, or its exception raised here."""
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(result: outcome.Outcome[T]) -> None:
        token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    trio.lowlevel.start_thread_soon(lambda: call(*args), deliver)
    return await trio.lowlevel.wait_task_rescheduled(_not_abortable)  # type: ignore[no-any-return]
