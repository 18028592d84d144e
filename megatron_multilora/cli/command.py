"""What every ``mmlora`` command shares: the refusal it raises and how it registers."""

from __future__ import annotations

import argparse
from collections.abc import Callable

EXIT_REFUSED = 2


class CommandError(Exception):
    """A refused command; the message says what was wrong, where, and how to fix it."""


class Commands:
    """The ``mmlora`` sub-command parsers: each module adds its commands with :meth:`add`."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._sub = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    def add(
        self, name: str, run: Callable[[argparse.Namespace], int], help_: str, run_dir: bool = False
    ) -> argparse.ArgumentParser:
        sub = self._sub.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        if run_dir:
            sub.add_argument("--run-dir", required=True, help="the run's run_dir")
        sub.set_defaults(run=run)
        return sub
