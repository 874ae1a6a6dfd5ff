"""How long a server takes to start and to replace a killed worker: fresh servers of the built-in model, of this tree
and of an earlier checkout in turns.

`python -m loadtests.start_time [--before DIR] [--starts 4] --out FILE.md`

Each start times `imgserve serve` from its launch to `/health/ready`, reads the idle server's PSS summed over its
process tree, then kills one inference worker with SIGKILL and times the server until it is ready again with a new
worker. With `--before`, the code at DIR starts in turns with this tree's, so both see the same machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from imgserve.testing import free_port, serve_command
from loadtests.lib.report import machine, publish
from loadtests.lib.servers import SOURCE, running_server

MIB = 2**20


def one_start(source: Path, work: Path) -> tuple[float, float, float]:
    """A fresh server of `source`: seconds to ready, idle summed PSS (MiB), seconds to replace a killed worker."""
    port = free_port()
    launched = time.monotonic()
    with running_server(serve_command(port), port, work / f"{port}.log", "/health/ready", {}, 180, source) as server:
        ready_s = time.monotonic() - launched
        time.sleep(2.0)  # idle: the workers have trimmed what their warm-up freed
        pss = server.tree_pss() / MIB
        before = set(server.worker_pids())
        killed = time.monotonic()
        os.kill(min(before), signal.SIGKILL)
        server.replaced_worker(before, timeout_s=120)
        return ready_s, pss, time.monotonic() - killed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.start_time", description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout of the code before a change, started in turns")
    parser.add_argument("--starts", type=int, default=4, help="fresh servers of each tree")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    trees = [("this", SOURCE), *([("before", args.before / "service")] if args.before else [])]
    rows = ["| start | code | to ready, s | idle PSS, MiB | a killed worker replaced, s |", "|---|---|---|---|---|"]
    found: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory(prefix="imgserve-start-") as folder:
        for start in range(args.starts):
            for name, source in trees if start % 2 == 0 else trees[::-1]:
                found[name].append(one_start(source, Path(folder)))
                ready_s, pss, replaced_s = found[name][-1]
                rows.append(f"| {start + 1} | {name} | {ready_s:.2f} | {pss:.0f} | {replaced_s:.2f} |")
                print(rows[-1], flush=True)
    for name, measured in found.items():
        medians = [statistics.median(column) for column in zip(*measured, strict=True)]
        rows.append(f"| median | {name} | {medians[0]:.2f} | {medians[1]:.0f} | {medians[2]:.2f} |")
    command = " ".join(["python -m loadtests.start_time", *(argv if argv is not None else sys.argv[1:])])
    header = f"# Start and worker-replacement time\n\n`{command}` on {machine()}.\n\n"
    return publish(header + "\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
