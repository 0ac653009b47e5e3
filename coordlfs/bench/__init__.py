"""Benchmarks: each runs its baselines and coordlfs side by side and prints ratios."""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from coordlfs.errors import Parser, UserError, exit_status

#: ``coordlfs bench NAME`` runs the module of that name in this package
BENCHMARKS = ("aligned", "cluster", "epochs", "fio", "hits", "hpsearch", "listing", "misses",
              "nodes", "overhead", "placement", "stagger", "uncached", "warm", "whatif")


def module_of(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")


def build_parser() -> argparse.ArgumentParser:
    """``coordlfs bench``'s arguments. Only this command loads the benchmark modules: the
    rest of the product (mount, the daemon, stats) never imports them."""
    parser = Parser(prog="coordlfs bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True, parser_class=Parser)
    for name in BENCHMARKS:
        module = module_of(name)
        assert module.__doc__
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    return parser


def main(argv: list[str]) -> int:
    """``coordlfs bench ARGS``. SIGTERM cleans up as Ctrl-C does: a bench holds cgroups,
    throttles and mounts."""
    args = build_parser().parse_args(argv)
    return exit_status("coordlfs", lambda: run_bench(module_of(args.bench), args),
                       sigterm_interrupts=True)


def run_bench(module: ModuleType, args: argparse.Namespace) -> int:
    """Run one benchmark; a degenerate measurement is a one-line error, never a traceback.

    A benchmark divides measured figures by one another and hands them to models that check
    their input (``coordlfs.models.stagger.JobProfile``). A figure that comes out 0 or out of range
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
