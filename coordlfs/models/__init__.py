"""Models of jobs, worked out offline from what a mount measured: the stagger advisor
(``stagger``: when to start a second job beside a first, and its catalog of profiles) and the
what-if analysis (``whatif``: epoch time and stalls for another cache size, CPU count or
storage speed). Pure arithmetic on JSON, for ``coordlfs stagger``, ``coordlfs whatif`` and the
benchmarks; the mount never imports them.

May import: the base only (``whatif``'s plot imports matplotlib when asked for).
"""
