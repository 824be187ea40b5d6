"""The one way pcs's ``python -m pcs.<command>`` tools describe themselves: the module's whole docstring as the
description, kept as written (its examples and lists stay readable), and every option with a help line
(``tests/test_cli.py`` holds each command to it, and to answering ``--help`` before anything heavy loads)."""
from __future__ import annotations

import argparse


def command(prog: str, doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
