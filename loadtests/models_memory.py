"""What several models cost: the summed PSS of one server serving 1, 2, 4 and 8 near-free models (a model
repository of loadtests.lib.toy_apis:NearFree, each at its own path), against one server per model.

`python -m loadtests.models_memory [--out loadtests/results/models-memory.md]`

Each server runs one worker and one front end, answers 8 requests on every model (each model warm), idles 2 s, and
its tree's PSS is read. The models share the server's processes (and so, on a GPU, its CUDA context): the ratio of
8 models to 1 is what they add beside it, against 8x for a server per model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

from imgserve.testing import RunningServer, free_port, serve_command
from loadtests.lib.images import sample_images
from loadtests.lib.report import machine
from loadtests.lib.servers import running_server

MIB = 2**20
COUNTS = (1, 2, 4, 8)
NEAR_FREE = "loadtests.lib.toy_apis:NearFree"


def repository(root: Path, count: int) -> Path:
    """A repository of `count` near-free models, m0 ... m{count-1}, at /m0 ... ."""
    for index in range(count):
        folder = root / f"m{index}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text(yaml.safe_dump({"api": NEAR_FREE, "api_path": f"/m{index}"}))
    return root


def settled_pss(server: RunningServer, count: int) -> int:
    """The tree's PSS once every model has answered 8 requests and the server has idled 2 s."""
    image = sample_images()[0]

    def post(index: int) -> int:
        files = {"file": (image.name, image.data, image.content_type)}
        return httpx.post(f"{server.url}/m{index % count}", files=files, timeout=60).status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(post, range(8 * count))) == {200}
    time.sleep(2)
    return server.tree_pss()


def measure(count: int, log_dir: Path) -> int:
    """PSS of one server serving `count` near-free models."""
    port = free_port()
    env = {
        "IMGSERVE_MODEL_REPOSITORY": str(repository(log_dir / f"repository-{count}", count)),
        "IMGSERVE_WORKERS_PER_DEVICE": "1",
        "IMGSERVE_API_SERVERS": "1",
    }
    log = log_dir / f"imgserve-{count}-models.log"
    with running_server(serve_command(port), port, log, "/health/ready", env) as server:
        return settled_pss(server, count)


def added_mib(pss: dict[int, int], count: int) -> str:
    """What each model beyond the first added, in MiB ("-" for one model)."""
    return f"{(pss[count] - pss[1]) / MIB / (count - 1):.1f}" if count > 1 else "-"


def table(log_dir: Path) -> str:
    pss = {count: measure(count, log_dir) for count in COUNTS}
    one = pss[1]
    rows = [
        f"| {count} | {pss[count] / MIB:.0f} | {pss[count] / one:.2f}x | {added_mib(pss, count)}"
        f" | {count * one / MIB:.0f} |"
        for count in COUNTS
    ]
    return "\n".join(
        [
            f"Machine: {machine()}",
            "",
            "| models in one server | PSS MiB | against one model | MiB per added model | one server per model, MiB |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Eight near-free models in one server cost {pss[8] / one:.2f}x the PSS of one (one server per model: 8x).",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="imgserve-models-memory-") as log_dir:
        text = table(Path(log_dir))
    print(text)
    if arguments.out:
        arguments.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
