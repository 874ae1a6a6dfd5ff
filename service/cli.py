"""The `imgserve` command: `serve` runs the server, `train` rebuilds the built-in model, `plan` replays autoscaling."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from service.config import Settings


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting; unset flags fall back to IMGSERVE_<NAME> and then the default."""
    for name, field in Settings.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=field.description)


def _fresh_metrics_dir() -> None:
    """prometheus_client multiprocess mode: one directory per server, wiped at start, set before any import."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.path.join(
        tempfile.gettempdir(), f"imgserve-metrics-{os.getpid()}"
    )
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def _serve(args: argparse.Namespace) -> int:
    _fresh_metrics_dir()
    from service.server import serve

    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    return serve(Settings(**overrides))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `imgserve` console script."""
    parser = argparse.ArgumentParser(prog="imgserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve_parser = sub.add_parser("serve", help="run the HTTP server")
    _add_settings_flags(serve_parser)
    serve_parser.set_defaults(func=_serve)

    from service import plan
    from service.models import train

    train.register(sub)
    plan.register(sub)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
