"""The hand-off between the front ends and the workers, used by both sides and the main process.

The server's private directory, the shared-memory slots that carry pixels, the datagram sockets that carry small
msgpack messages (requests one way, answers the other), the counters every process shares, and the front end's
dispatcher. May import only the shared top-level modules: both sides import it, it imports neither.
"""
