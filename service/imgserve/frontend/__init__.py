"""The HTTP front ends: forked processes, one event loop each, sharing the listening port.

A request's way through them: connections (limits on sockets, headers and uploads) -> tracing (the request's id and
spans) -> auth -> admission (the pod's queue bound, deadlines) -> routes and the protocols (/predict, v2 over HTTP and
gRPC) -> inference (decode into a slot, hand off, wait) -> responding (the answer). app.py builds the application,
process.py runs it. May import: handoff, models and the shared top-level modules; never the worker, the supervisor or
the composition root.
"""
