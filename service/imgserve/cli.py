"""The `imgserve` command: `serve` runs the server, `train` rebuilds the built-in model, `plan` replays autoscaling."""

from __future__ import annotations

import argparse
import os
import stat
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from litserve import LitAPI
from pydantic import ValidationError
from pydantic_settings import SettingsError

from imgserve.config import CONCERNS, Settings
from imgserve.handoff.directory import ServerDirectory


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting (--x/--no-x for booleans, and for a boolean whose unset value means "decided for the
    device"), a group of them per concern; unset ones fall back to IMGSERVE_<NAME>, then the default. A description
    is help text as written: its `%` is escaped, since argparse %-formats help."""
    for concern in CONCERNS:
        group = parser.add_argument_group((concern.__doc__ or concern.__name__).splitlines()[0].rstrip("."))
        for name, field in concern.model_fields.items():
            flag = f"--{name.replace('_', '-')}"
            text = (field.description or "").replace("%", "%%")
            if field.annotation in (bool, bool | None):
                group.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=text)
            elif typing.get_origin(field.annotation) is list:  # repeated
                group.add_argument(flag, dest=name, default=None, action="append", help=text)
            else:
                group.add_argument(flag, dest=name, default=None, help=text)


def settings_problem(error: ValidationError | SettingsError) -> str:
    """One line naming each invalid setting (as its --flag) and what is wrong with it."""
    if isinstance(error, SettingsError):
        return str(error)
    problems = []
    for item in error.errors():
        name = str(item["loc"][0]).replace("_", "-") if item["loc"] else ""
        message = item["msg"].removeprefix("Value error, ")
        given = f" (got {item['input']!r})" if name and not isinstance(item["input"], dict) else ""
        problems.append(f"--{name}: {message}{given}" if name else message)
    return "invalid settings: " + "; ".join(problems)


def _use_metrics_directory(own: Path) -> str | None:
    """Set prometheus_client's multiprocess directory before any import of it: the server's own, or the operator's
    PROMETHEUS_MULTIPROC_DIR (a directory of this user's that no other can write; its old files are removed).
    Returns what is wrong with the operator's, if anything."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    path = Path(given) if given else own
    if given:
        problem = f"PROMETHEUS_MULTIPROC_DIR={given} is not a directory of this user's that only it can write"
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            facts = path.lstat()
            if not stat.S_ISDIR(facts.st_mode) or facts.st_uid != os.getuid() or facts.st_mode & 0o022:
                return problem
            for old in path.glob("*.db"):
                old.unlink()
        except OSError as exc:
            return f"{problem} ({exc})"
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return None


def _serve(args: argparse.Namespace) -> int:
    return serve(**{k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None})


def serve(api: LitAPI | str | Sequence[LitAPI | str] | None = None, **settings: Any) -> int:
    """Run the server until SIGTERM or Ctrl-C, as `imgserve serve` does: on `api` (an ImageAPI or a plain LitAPI
    instance, or "module:Class" as --api names one, or a list of them, as `litserve.LitServer([A(), B()])` takes;
    None: --api's and --model's, else the built-in API over --model), with `settings` as keyword arguments over the
    IMGSERVE_<NAME> variables and the defaults (docs/settings.md). Returns the exit code: 0 after a clean drain, 2 for
    anything the user got wrong (printed in one line)."""
    given = [] if api is None else [api] if isinstance(api, LitAPI | str) else list(api)
    apis = [one for one in given if isinstance(one, LitAPI)]
    named = [one for one in given if isinstance(one, str)]  # the --api setting, which the command line passes so
    if named:
        settings["api"] = [*named, *settings.get("api", [])]
    try:
        resolved = Settings(**settings)
    except (ValidationError, SettingsError) as error:
        print(f"imgserve: {settings_problem(error)}", file=sys.stderr)
        return 2
    try:
        directory = ServerDirectory.create()
    except OSError as exc:
        print(f"imgserve: cannot make the server's private directory: {exc}", file=sys.stderr)
        return 2
    from imgserve.supervisor import forkserver

    try:
        problem = _use_metrics_directory(directory.metrics)
        if problem:
            print(f"imgserve: {problem}", file=sys.stderr)
            return 2
        with directory.temporary_files(), forkserver.running(directory.root):
            from imgserve import server  # torch, imported while the fork server imports it too

            return server.serve(resolved, directory, apis)
    except forkserver.ForeignForkServer as exc:  # raised before the server starts
        print(f"imgserve: {exc}", file=sys.stderr)
        return 2
    finally:
        directory.remove()


def _train(args: argparse.Namespace) -> int:
    from imgserve.tools import train  # torch, imported only when the command needs it: --help stays quick

    return train.run(args)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (what was wrong and where --help is), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `imgserve` console script."""
    parser = _Parser(prog="imgserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve_parser = sub.add_parser("serve", help="run the HTTP server")
    _add_settings_flags(serve_parser)
    serve_parser.set_defaults(func=_serve)

    train_parser = sub.add_parser("train", help="train the built-in denoiser and write its weights")
    train_parser.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    train_parser.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights")
    train_parser.add_argument("--out", help="where to write the safetensors weights (default: the built-in model's)")
    train_parser.set_defaults(func=_train)

    from imgserve.tools import plan

    plan.register(sub)

    args = parser.parse_args(argv)
    command: Callable[[argparse.Namespace], int] = args.func
    return command(args)
