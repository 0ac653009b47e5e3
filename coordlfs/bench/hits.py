"""Cache-hit throughput: open+read+close of small files against tmpfs and pyfuse3 baselines."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError
