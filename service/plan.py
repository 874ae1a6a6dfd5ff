"""Placeholder until the autoscaling planner lands (issue 7): registers nothing yet."""

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
