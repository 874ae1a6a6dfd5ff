"""The inference workers: processes forked from the fork server (preload.py), each holding the models on its device.

process (the worker's life and loop) -> gather (take a batch off the request socket) -> serving (set up and measure the
API; deadlines, slots in and out) -> batching (memory-bounded chunks, the model call, out-of-memory splits) -> tracing
(a traced batch's spans, once its answers are sent). May import: handoff, models and the shared top-level modules;
never the front end, the supervisor or the composition root.
"""
