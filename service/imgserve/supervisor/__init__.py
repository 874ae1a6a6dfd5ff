"""The main process's part: watching every child (replace the dead, or end the server with one line), loading and
unloading the models (the memory they share on each device), and the drain on SIGTERM or Ctrl-C. May import: handoff,
models (the shared weights it prepares and frees) and the shared top-level modules.
"""
