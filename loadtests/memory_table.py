"""The memory table: PSS of imgserve's whole process tree at 1, 2 and 4 workers, for the built-in model and for a
256 MiB one, with the weights shared and (for comparison) with a private copy per worker.

`python -m loadtests.memory_table [--out loadtests/results/memory.md]`

Each server is started on loopback, answers 16 requests (every worker warm, every weight page read), idles 2 s, and
its tree's PSS is read (shared pages charged 1/k to each of the k processes that map them). Per-worker overhead is
(PSS at 4 workers - PSS at 1) / 3 with the built-in model; per-front-end overhead the PSS that a second HTTP front
end adds (--api-servers 2).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from imgserve.testing import RunningServer, free_port, serve_command
from loadtests.lib.images import sample_images
from loadtests.lib.report import machine
from loadtests.lib.servers import running_server

MIB = 2**20
WORKERS = (1, 2, 4)


def settled_pss(server: RunningServer) -> int:
    images = sample_images()

    def post(index: int) -> int:
        image = images[index % len(images)]
        files = {"file": (image.name, image.data, image.content_type)}
        return httpx.post(server.url + "/predict", files=files, timeout=60).status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(post, range(16))) == {200}
    time.sleep(2)
    return server.tree_pss()


def measure(settings: dict[str, str], log_dir: Path) -> tuple[int, dict]:
    """PSS of a server with these IMGSERVE_* settings, and its /info."""
    port = free_port()
    env = {f"IMGSERVE_{key.upper()}": value for key, value in settings.items()}
    log = log_dir / f"imgserve-{port}.log"
    with running_server(serve_command(port), port, log, "/health/ready", env) as server:
        return settled_pss(server), httpx.get(server.url + "/info", timeout=10).json()


def table(log_dir: Path) -> str:
    from safetensors.torch import save_file

    from loadtests.lib.toy_models import heavy_weights

    heavy = log_dir / "heavy.safetensors"
    save_file(heavy_weights().state_dict(), str(heavy))
    models = {
        "built-in denoiser": {},
        "256 MiB model": {"model": str(heavy), "model_factory": "loadtests.lib.toy_models:heavy_weights"},
    }
    rows = []
    overheads: dict[str, float] = {}
    for name, model in models.items():
        for share in ("true", "false"):
            pss, weights = {}, 0
            for workers in WORKERS:
                settings = {**model, "workers_per_device": str(workers), "share_weights": share, "api_servers": "1"}
                pss[workers], info = measure(settings, log_dir)
                weights = info["weights"]["bytes"]
            how = "shared" if share == "true" else "private copies"
            cells = " | ".join(f"{pss[w] / MIB:.0f}" for w in WORKERS)
            rows.append(f"| {name} | {weights / MIB:.2f} | {how} | {cells} |")
            if name == "built-in denoiser" and share == "true":
                overheads["worker"] = (pss[4] - pss[1]) / 3
                overheads["one worker"] = pss[1]
    two_front_ends, _ = measure({"workers_per_device": "1", "api_servers": "2"}, log_dir)
    overheads["front end"] = two_front_ends - overheads["one worker"]
    return "\n".join(
        [
            f"Machine: {machine()}",
            "",
            "| model | weights (MiB) | weights | PSS 1 worker (MiB) | 2 workers | 4 workers |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Per-worker overhead (built-in model, shared): {overheads['worker'] / MIB:.0f} MiB; "
            f"per-front-end overhead: {overheads['front end'] / MIB:.0f} MiB.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.memory_table", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/memory.md"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="imgserve-memory-") as logs:
        report = table(Path(logs)) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
