"""The inference workers: spawned processes, each holding the model on its device.

gather (take a batch off the request socket) -> api (deadlines, slots in and out) -> batching (memory-bounded
chunks, the model call, out-of-memory splits). May import: handoff, models and the shared top-level modules; never
the front end, the supervisor or the composition root.
"""
