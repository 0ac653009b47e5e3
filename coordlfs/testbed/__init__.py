"""Machinery to build datasets, network namespaces, memory cgroups and mounts under controlled
conditions, for the tests and the benchmarks alike; the product never imports it.

A test and a benchmark both need a dataset of known files, a page cache dropped on purpose,
a memory budget, a private network of nodes, and a real mount that is gone afterwards
whatever happened. Kept here, below both, so that the tests' fixtures load no benchmark and
the benchmarks measure under the same conditions the tests check.
"""
