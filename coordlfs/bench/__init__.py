"""Benchmarks: each runs its baselines and coordlfs side by side and prints ratios."""
