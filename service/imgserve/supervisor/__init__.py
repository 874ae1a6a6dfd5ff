"""The main process's part: watching every child (replace the dead, or end the server with one line) and the drain
on SIGTERM or Ctrl-C. May import: handoff and the shared top-level modules.
"""
