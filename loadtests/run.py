"""Run the Locust load test headless against a server, scrape its queue depth, and write CSV, HTML and a PNG plot.

    python -m loadtests.run --host http://127.0.0.1:8000 --shape step --users 32 --duration 60 \\
        --out loadtests/results/step
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from loadtests.lib.plot import plot_run
from loadtests.lib.scrape import QUEUE_DEPTH, MetricsScraper
from loadtests.lib.shapes import SHAPES

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
SHUTDOWN_GRACE_S = 60


def run_load_test(host: str, shape: str, users: int, duration_s: int, out: Path) -> int:
    """Locust's exit code (0: no failures); the reports land in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
        "--shape", shape, "--users", str(users), "--run-time", f"{duration_s}s",
        "--csv", str(out / "locust"), "--csv-full-history", "--html", str(out / "report.html"), "--only-summary",
    ]  # fmt: skip
    with MetricsScraper(host, names=(QUEUE_DEPTH,), interval_s=1.0, max_s=duration_s + SHUTDOWN_GRACE_S) as scraper:
        finished = subprocess.run(command, timeout=duration_s + SHUTDOWN_GRACE_S, check=False)
    scraper.write_csv(out / "metrics.csv")
    plot_run(out / "locust_stats_history.csv", out / "metrics.csv", out / "plot.png")
    return finished.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.run", description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="step")
    parser.add_argument("--users", type=int, default=32, help="peak concurrent users")
    parser.add_argument("--duration", type=int, default=60, help="seconds (the shape is stretched over them)")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/run"), help="directory for the reports")
    args = parser.parse_args(argv)
    code = run_load_test(args.host, args.shape, args.users, args.duration, args.out)
    print(f"reports in {args.out}: report.html, locust_stats*.csv, metrics.csv, plot.png (locust exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
