"""Triton's perf_analyzer against imgserve over the Open Inference Protocol (HTTP v2 binary tensors, gRPC and gRPC's
stream), next to imgserve's own closed-loop client on /predict (multipart) at the same concurrency, with the same
real JPEGs. imgserve serves the statistics extension, so each level also has the server's side: queue and compute
times, as perf_analyzer reads them from the server.

perf_analyzer (PyPI perf-analyzer) needs glibc >= 2.38, newer than these machines': it runs in a Debian trixie
container built once with podman (mmdebstrap -> podman import -> podman build; see ../shared anchors containers.md)
and reaches the server on the host's loopback (--network host).

    python -m loadtests.perf_analyzer --side 128 --sweep 1:16 --compare 64 --out loadtests/results/perf_analyzer
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from imgserve.testing import LOOPBACK, free_port, serve_command
from loadtests.lib.closed_loop import run_closed_loop
from loadtests.lib.images import square_jpegs
from loadtests.lib.servers import running_server

PERF_ANALYZER = "2.60.0"
IMAGE = f"localhost/imgserve-perf-analyzer:{PERF_ANALYZER}"
MODEL = "denoiser"
STABILITY_PERCENT = 60
SERVER_COLUMNS = ("Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output")
COMPARE_ROUNDS = 2  # the comparison alternates the clients this many times (the machine's load drifts)
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
CONTAINERFILE = f"""FROM localhost/imgserve-trixie:base
RUN python3 -m venv /opt/pa \\
    && PIP_CERT=/host-ca.crt /opt/pa/bin/pip install --no-cache-dir perf-analyzer=={PERF_ANALYZER}
ENV PATH=/opt/pa/bin:$PATH
"""


@dataclass
class Point:
    """One concurrency level of one client."""

    client: str
    concurrency: int
    throughput: float  # answers/s
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    server_us: dict[str, int] | None = None  # the server's side (its statistics): queue, compute input/infer/output


def podman(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """podman with runc and explicit ulimits (what these machines need), failing loudly."""
    conf = Path(tempfile.gettempdir()) / "imgserve-perf-analyzer-containers.conf"
    conf.write_text(CONTAINERS_CONF)
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    return subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout, check=True)


def ensure_image(work: Path) -> None:
    """Build the perf_analyzer image unless it is there: a trixie rootfs, then a venv with perf-analyzer."""
    if subprocess.run(["podman", "image", "exists", IMAGE], check=False).returncode == 0:
        return
    rootfs = work / "trixie.tar"
    include = "--include=python3,python3-venv,ca-certificates"
    subprocess.run(["mmdebstrap", "--variant=minbase", include, "trixie", str(rootfs)], check=True, timeout=1800)
    podman("import", str(rootfs), "localhost/imgserve-trixie:base")
    (work / "Containerfile").write_text(CONTAINERFILE)
    ca = os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
    podman("build", "--format", "docker", "--network", "host", "-v", f"{ca}:/host-ca.crt:ro", "-t", IMAGE, str(work))


def write_input_data(path: Path, images: list[bytes]) -> None:
    """perf_analyzer's --input-data: each step one JPEG as a BYTES element (base64 of length prefix + bytes)."""
    steps = [
        {"image": {"content": {"b64": base64.b64encode(struct.pack("<I", len(i)) + i).decode()}, "shape": [1]}}
        for i in images
    ]
    path.write_text(json.dumps({"data": steps}))


def perf_analyzer(
    work: Path, protocol: str, port: int, concurrency: str, interval_ms: int, name: str = "", streaming: bool = False
) -> list[Point]:
    """Run perf_analyzer over `protocol` (http or grpc; `streaming`: gRPC's stream) for `concurrency` (a:b[:step]);
    one Point per level, with the server's side where its CSV has it. Its output is kept in `<csv>.log`.

    On a shared machine the throughput of successive windows can differ by half: a level is taken as stable once
    three windows agree within STABILITY_PERCENT (perf_analyzer's default 10% would never settle here). A level
    that does not settle ends perf_analyzer's sweep without an error code, so every level is checked to be there."""
    client = f"{protocol} streaming" if streaming else protocol
    csv_name = f"{client.replace(' ', '-')}-{concurrency.replace(':', '-')}{name}.csv"
    command = [
        "perf_analyzer", "-m", MODEL, "-i", protocol, "-u", f"{LOOPBACK}:{port}", "--input-data", "/work/images.json",
        "--concurrency-range", concurrency, "--measurement-interval", str(interval_ms), "--max-trials", "10",
        "--stability-percentage", str(STABILITY_PERCENT), "-f", f"/work/{csv_name}",
    ]  # fmt: skip
    command += ["--streaming"] if streaming else []
    run = podman("run", "--rm", "--network", "host", "-v", f"{work}:/work", IMAGE, *command, timeout=3600)
    (work / f"{csv_name}.log").write_text(run.stdout + run.stderr)
    first, last, *step = (int(part) for part in concurrency.split(":"))
    expected = list(range(first, last + 1, step[0] if step else 1))
    rows = []
    if (work / csv_name).exists():
        with (work / csv_name).open() as file:
            rows = sorted(csv.DictReader(file), key=lambda row: int(row["Concurrency"]))
    if [int(row["Concurrency"]) for row in rows] != expected:
        raise RuntimeError(
            f"perf_analyzer {client} did not measure every level of {concurrency}:\n{run.stdout[-2000:]}"
        )
    return [
        Point(
            f"perf_analyzer {client}",
            int(row["Concurrency"]),
            float(row["Inferences/Second"]),
            _latency_ms(row, "p50 latency"),
            _latency_ms(row, "p99 latency"),
            0,  # perf_analyzer stops with an error (check=True above) on any failed request
            {column: int(row[column]) for column in SERVER_COLUMNS} if SERVER_COLUMNS[0] in row else None,
        )
        for row in rows
    ]


def _latency_ms(row: dict[str, str], column: str) -> float | None:
    return int(row[column]) / 1000 if row.get(column) else None


def closed_loop(port: int, users: int, images: list, seconds: float) -> Point:
    """imgserve's own client: multipart uploads to /predict, `users` concurrent, measured for `seconds`."""
    result = run_closed_loop(
        f"http://{LOOPBACK}:{port}/predict", users, seconds, warmup_s=2, images=images, decode_answers=False
    )
    return Point(
        "closed loop /predict",
        users,
        result.rps,
        result.latency_ms(0.5),
        result.latency_ms(0.99),
        result.failed + result.shed,
    )


def measure(args: argparse.Namespace, work: Path) -> list[Point]:
    """Start imgserve with gRPC on, then sweep and compare."""
    images = list(square_jpegs(args.side, count=8))
    write_input_data(work / "images.json", [image.data for image in images])
    port, grpc_port = free_port(), free_port()
    env = {"IMGSERVE_MAX_QUEUE_DEPTH": str(4 * args.compare)}  # c=64 is admitted, not shed
    points: list[Point] = []
    with running_server(serve_command(port, grpc_port), port, work / "server.log", "/health/ready", env):
        for protocol, target in (("http", port), ("grpc", grpc_port)):
            points += perf_analyzer(work, protocol, target, args.sweep, args.interval_ms)
        points += perf_analyzer(work, "grpc", grpc_port, args.sweep, args.interval_ms, streaming=True)
        compare = f"{args.compare}:{args.compare}"
        for round_ in range(COMPARE_ROUNDS):
            points.append(closed_loop(port, args.compare, images, args.interval_ms / 1000 * 4))
            for protocol, target in (("http", port), ("grpc", grpc_port)):
                points += perf_analyzer(work, protocol, target, compare, args.interval_ms, f"-{round_}")
    return points


def report(points: list[Point], compare: int) -> dict:
    """The comparison at `compare` users (each client's mean over the rounds) and its three targets."""
    rounds: dict[str, list[float]] = {}
    for point in points:
        if point.concurrency == compare:
            rounds.setdefault(point.client, []).append(point.throughput)
    at = {client: sum(values) / len(values) for client, values in rounds.items()}
    http, grpc, multipart = at["perf_analyzer http"], at["perf_analyzer grpc"], at["closed loop /predict"]
    return {
        "points": [asdict(p) for p in points],
        "v2_binary_over_multipart": http / multipart,
        "grpc_over_http_v2": grpc / http,
        "sweep_errors": sum(p.errors for p in points),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", type=int, default=128, help="JPEG side in pixels")
    parser.add_argument("--sweep", default="1:16", help="perf_analyzer --concurrency-range of the sweep")
    parser.add_argument("--compare", type=int, default=64, help="concurrency of the side-by-side comparison")
    parser.add_argument("--interval-ms", type=int, default=3000, help="perf_analyzer --measurement-interval")
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/perf_analyzer"))
    args = parser.parse_args()
    if not shutil.which("podman"):
        print("perf_analyzer runs in a podman container: install podman (apt-get install podman)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out.resolve()
    ensure_image(work)
    result = report(measure(args, work), args.compare)
    (work / "report.json").write_text(json.dumps(result, indent=2))
    for point in result["points"]:
        print(
            f"{point['client']:>32} c={point['concurrency']:>3} {point['throughput']:8.1f}/s "
            f"p50 {point['p50_ms']} ms p99 {point['p99_ms']} ms errors {point['errors']} server {point['server_us']}"
        )
    print(f"v2 binary / multipart at c={args.compare}: {result['v2_binary_over_multipart']:.2f}")
    print(f"gRPC / HTTP v2 at c={args.compare}: {result['grpc_over_http_v2']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
