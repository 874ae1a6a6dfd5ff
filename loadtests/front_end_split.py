"""How a burst of new connections splits across the front ends: fresh servers loaded by users who connect at once.

`python -m loadtests.front_end_split [--before DIR] [--starts 4] [--after-ready 0] [--users 64] --out FILE.md`

The front ends accept from one shared listening socket, and a front end takes every connection waiting when its
event loop wakes, so which front end holds the users' keep-alive connections depends on which was free when they
connected. Each start serves the near-free model file, waits `--after-ready` seconds after it is ready, and loads it
from `--users` closed-loop users connecting at once; the table gives its answers/s and each front end's CPU seconds
in the load (one near zero: that front end got no connection). With `--before`, the code at DIR starts in turns with
this tree's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from imgserve.testing import FORK_SERVER, RunningServer, free_port, serve_command
from loadtests.lib.closed_loop import run_closed_loop
from loadtests.lib.images import square_jpegs
from loadtests.lib.report import machine, publish
from loadtests.lib.servers import SOURCE, running_server
from loadtests.overhead import write_clamp_model


def front_ends(server: RunningServer) -> list[psutil.Process]:
    """The server's front-end processes: its children that are neither workers nor multiprocessing's helpers (the
    resource tracker, the fork server)."""
    workers = set(server.worker_pids())
    helpers = ("resource_tracker", FORK_SERVER)
    children = [process for process in server.tree()[1:] if process.pid not in workers]
    commands = {process.pid: " ".join(process.cmdline()) for process in children}
    return [process for process in children if not any(helper in commands[process.pid] for helper in helpers)]


def one_start(source: Path, model: Path, args: argparse.Namespace, work: Path) -> tuple[float, list[float]]:
    """A fresh server of `source`: answers/s, and each front end's CPU seconds in the load."""
    port = free_port()
    env = {"IMGSERVE_MODEL": str(model)}
    with running_server(serve_command(port), port, work / f"{port}.log", "/health/ready", env, 180, source) as server:
        time.sleep(args.after_ready)
        processes = front_ends(server)
        before = [sum(process.cpu_times()[:2]) for process in processes]
        result = run_closed_loop(f"{server.url}/predict", args.users, args.seconds, images=square_jpegs(128))
        after = [sum(process.cpu_times()[:2]) for process in processes]
        if result.failed:
            raise RuntimeError(result.errors())
        return result.rps, [end - start for start, end in zip(before, after, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.front_end_split", description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout of the code before a change, started in turns")
    parser.add_argument("--starts", type=int, default=4, help="fresh servers of each tree")
    parser.add_argument("--after-ready", type=float, default=0.0, help="seconds between ready and the load")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    trees = [("this", SOURCE), *([("before", args.before / "service")] if args.before else [])]
    rows = ["| start | code | answers/s | front ends' CPU s in the load |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="imgserve-split-") as folder:
        work = Path(folder)
        model = write_clamp_model(work / "clamp.ts")
        for start in range(args.starts):
            for name, source in trees if start % 2 == 0 else trees[::-1]:
                rps, cpu = one_start(source, model, args, work)
                rows.append(f"| {start + 1} | {name} | {rps:.0f} | {', '.join(f'{s:.2f}' for s in cpu)} |")
                print(rows[-1], flush=True)
    command = " ".join(["python -m loadtests.front_end_split", *(argv if argv is not None else sys.argv[1:])])
    header = f"# How a burst of connections splits across the front ends\n\n`{command}` on {machine()}.\n\n"
    return publish(header + "\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
