"""Benchmarks: each runs its baselines and coordlfs side by side and prints ratios."""

from __future__ import annotations

import argparse
from types import ModuleType

from coordlfs.errors import UserError


def run_bench(module: ModuleType, args: argparse.Namespace) -> int:
    """Run one benchmark; a degenerate measurement is a one-line error, never a traceback.

    A benchmark divides measured figures by one another and hands them to models that check
    their input (``coordlfs.stagger.JobProfile``). A figure that comes out 0 or out of range
    (a machine too fast for a record's resolution, a dataset of empty files) raises
    ValueError or ArithmeticError deep inside, after the mounts and cgroups on the way out
    were cleaned up by their ``with`` blocks. What the user can do about it is change the
    settings, so it reaches them as one line naming the bench, like any bad input.
    """
    try:
        return module.run(args)
    except (ArithmeticError, ValueError) as e:
        detail = " ".join(str(e).split()) or "no detail"
        raise UserError(f"bench {args.bench}: a measurement came out degenerate "
                        f"({e.__class__.__name__}: {detail}); try other settings") from None
