"""How a figure names a run setting: its knobs as the run's identity lists them (``RunIdentity.setting_knobs``,
read from the run folder's config; the joined setting string cannot be split back, since keys and values hold
underscores), the question's place in words, in lines as wide as a title has room for."""
from __future__ import annotations

import textwrap
from pathlib import Path

from ..identity import RunIdentity
from ..run_folder import saved_config

NO_BREAK = "\u00a0"
IN_WORDS = {"query_aware=False": "question after compression", "query_aware=True": "question inside"}


def setting_knobs(run_dir: str | Path) -> list[str]:
    """The run's setting knobs, the question's place and its follow-ups in words."""
    return [in_words(knob) for knob in RunIdentity(saved_config(Path(run_dir))).setting_knobs]


def in_words(knob: str) -> str:
    if knob.startswith("follow_up="):
        n = int(knob.split("=", 1)[1])
        return f"{n} follow-up{'s' if n > 1 else ''} after compression"
    return IN_WORDS.get(knob, knob)


def method_knobs(run_dir: str | Path) -> list[str]:
    """The run's method knobs and conventions (``RunIdentity.method_knobs``)."""
    return RunIdentity(saved_config(Path(run_dir))).method_knobs


def wrapped(parts: list[str], width: int) -> str:
    """``parts`` joined by commas, in lines of at most ``width`` characters where no part is longer (a part is
    never broken: the spaces inside one are held together while wrapping)."""
    held = ", ".join(part.replace(" ", NO_BREAK) for part in parts)
    lines = textwrap.wrap(held, width, break_long_words=False, break_on_hyphens=False)
    return "\n".join(line.replace(NO_BREAK, " ") for line in lines)
