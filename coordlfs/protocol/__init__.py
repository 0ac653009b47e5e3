"""The control protocol's declarations: every command, its arguments and who may run it (``spec``),
who sent a request (``Caller``), where a domain attaches its handlers (``Served``), and the
order a shared seed means (``order``), which the daemon and the jobs must compute alike.

Declarations only: the engine answering the control file is ``coordlfs.fs.control_server``
(above every domain), the jobs' client is ``coordlfs.control``; each domain's handlers live with
the domain and import only this. Stdlib only, as jobs import it. May import: ``coordlfs.system``
and the base.
"""
