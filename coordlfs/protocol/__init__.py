"""The control protocol, declarations, server and client in one place: every command, its
arguments and who may run it (``spec``), who sent a request (``Caller``), where a domain
attaches its handlers (``Served``); the engine that answers the control file in the daemon
(``server``); the jobs' Python client of it (``client``, public as ``coordlfs.control``); and
the order a shared seed means (``order``), which the daemon and the jobs must compute alike.

The server runs every domain's commands without importing a domain: each domain's handlers
live with the domain, import only the declarations, and are handed to the server
(``Served.serve``). Stdlib only but ``server`` (trio), which only the daemon loads, as jobs
import the rest. May import: ``coordlfs.system`` and the base.
"""
