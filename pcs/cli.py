"""The one way pcs's ``python -m pcs.<command>`` tools describe themselves: the module's whole docstring as the
description, kept as written (its examples and lists stay readable), and every option with a help line
(``tests/test_cli.py`` holds each command to it, and to answering ``--help`` before anything heavy loads)."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """A bad argument is one line naming it and what ``--help`` lists, exit 2, as every user error in pcs."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def command(prog: str, doc: str | None) -> argparse.ArgumentParser:
    return Parser(prog=f"python -m {prog}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
