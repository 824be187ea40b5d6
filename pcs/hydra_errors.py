"""Hydra's own refusals as pcs reports every user error: one line naming the value and the fix, exit 2.

Hydra rejects some overrides while it composes the config, before pcs sees it: an option a group does not have
(``method=snapk``), a key the config does not have (``method.floor=0.1`` on a method without that knob,
``foo=1``), a ``+`` on a key that exists, an override it cannot parse. It prints several lines and exits 1. ``run.py``
routes those errors through ``one_line``, which names the value, the nearest options or knobs and what to write
instead. Torch-free: it reads the config tree only.
"""
from __future__ import annotations

import difflib
import re
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import CONF_DIR, compose, group_file, is_declaration, options
from .errors import ConfigError


def nearest(word: str, choices) -> list[str]:
    return difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)


def did_you_mean(word: str, choices) -> str:
    close = nearest(word, choices)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def unknown_option(group: str, name: str, choices: list[str]) -> str:
    return (f"{group}={name} is not an option{did_you_mean(name, choices)}; choose one of: "
            f"{', '.join(c for c in choices if not c.startswith('_'))}")


def overrides_of(argv: list[str]) -> list[str]:
    """The command line's overrides (``key=value``, ``+key=value``, ``~key``), without Hydra's flags."""
    return [a for a in argv if not a.startswith("-") and ("=" in a or a.startswith("~"))]


def override_for(key: str, overrides: list[str]) -> str:
    """The override of ``key`` as the user wrote it (``key=value`` if the command line has none)."""
    for text in overrides:
        if text.lstrip("+~").split("=", 1)[0] == key:
            return text
    return key


def base_config(overrides: list[str], skip: str) -> DictConfig | None:
    """The config the other overrides compose, to say what the rejected one could have named; None where they
    do not compose either (each sweep's first value stands for the sweep)."""
    kept = [o.split(",")[0] if "," in o and "[" not in o else o for o in overrides if o != skip]
    try:
        return compose(kept)
    except Exception:  # noqa: BLE001 - the other overrides may be wrong too: compose what the defaults give
        try:
            return compose([])
        except Exception:  # noqa: BLE001
            return None


def knob_names(node) -> list[str]:
    if not isinstance(node, DictConfig):
        return []
    return [k for k in node if not is_declaration(k) and k not in ("name", "defaults")]   # a file's defaults list


def unknown_key(key: str, text: str, overrides: list[str]) -> str:
    """``text`` sets ``key``, which the composed config does not have."""
    base = base_config(overrides, text)
    parts = key.split(".")
    depth = 0           # how much of the path exists
    node = base
    while base is not None and depth < len(parts) - 1 and isinstance(node, DictConfig) and parts[depth] in node:
        node = node[parts[depth]]
        depth += 1
    parent, missing = ".".join(parts[:depth]), parts[depth]
    if depth == 1 and (CONF_DIR / parent).is_dir() and isinstance(node, DictConfig) and "name" in node:
        group, chosen = parent, node.name
        own = knob_names(group_file(group, chosen))
        having = [o for o in options(group) if missing in group_file(group, o)]
        line = f"{text}: {group}={chosen} has no knob {missing}"
        if having:
            line += f"; {group}s that have it: {', '.join(having)} (e.g. {group}={having[0]} {text.lstrip('+')})"
        else:
            close = nearest(missing, own)
            line += f"{' (did you mean ' + ' or '.join(close) + '?)' if close else ''}"
        return line + f"; its knobs: {', '.join(own) or 'none'}"
    keys = knob_names(node) if isinstance(node, DictConfig) else []
    where = f"{parent} has no key {missing}" if parent else f"the config has no key {missing}"
    value = text.split("=", 1)[1] if "=" in text else "..."
    return (f"{text}: {where}{did_you_mean(missing, keys)}; a key of your own needs a +: "
            f"+{key}={value} (docs/configuration.md lists every knob)")


def one_line(err: Exception, argv: list[str]) -> str | None:
    """pcs's message for an error Hydra raised while composing ``argv``'s config, or None for one that is not a
    user's (a failure of the run itself keeps Hydra's report)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    if isinstance(err, ConfigError):          # pcs's own, raised by a launcher's checks of a sweep
        return str(err)
    overrides = overrides_of(argv)
    message = str(err).strip()
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, _, name = err.missing_cfg_file.rpartition("/")
        choices = list(err.options or []) or options(group)
        return unknown_option(group, name, choices)
    if isinstance(err, OverrideParseException):
        detail = message.splitlines()[0] if message else "it cannot be read"
        return (f"cannot read the override {err.override!r}: {detail}; write key=value, a list as key=[a,b], "
                f"a sweep (with -m) as key=a,b")
    if not isinstance(err, ConfigCompositionException):
        return None
    if match := re.match(r"Could not override '([^']+)'\.\s*To append to your config use", message):
        key = match.group(1)
        return unknown_key(key, override_for(key, overrides), overrides)
    if match := re.match(r"Could not append to config\. An item is already at '([^']+)'", message):
        key = match.group(1)
        text = override_for(key, overrides)
        return f"{text}: {key} exists already; set it without the +: {text.lstrip('+')}"
    if match := re.match(r"Could not override '([^']+)'\. No match in the defaults list", message):
        group = match.group(1)
        text = override_for(group, overrides)
        parent, _, sub = group.partition("/")
        owners = [o for o in options(parent) if any(isinstance(entry, DictConfig) and sub in entry
                                                     for entry in group_file(parent, o).get("defaults", []))]
        hint = f"; it is a group of {parent}={', '.join(owners)} only" if owners else ""
        return f"{text}: the chosen options have no group {group}{hint}"
    return f"{'; '.join(line.strip() for line in message.splitlines() if line.strip())}"


def refused_sweep_dirs(started: float, argv: list[str]) -> None:
    """A sweep refused before any job ran leaves no folder: Hydra writes its sweep folder's multirun.yaml before
    the cells are checked, and that folder goes again if this process made it and nothing else is in it (the
    folder ``hydra.sweep.dir=`` names, else those of Hydra's default ``multirun/<date>/<time>``)."""
    named = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("hydra.sweep.dir=")]
    for folder in [Path(named[-1])] if named else sorted(Path("multirun").glob("*/*")):
        if not folder.is_dir() or folder.stat().st_mtime < started - 1 or \
                [p.name for p in folder.iterdir()] not in ([], ["multirun.yaml"]):
            continue
        (folder / "multirun.yaml").unlink(missing_ok=True)
        while folder.resolve() != Path.cwd().resolve() and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


def reporting_in_one_line(run_and_report):
    """Hydra's ``run_and_report`` (which prints an error and exits 1), with a user's error reported by
    ``one_line`` and exit 2 instead."""
    started = time.time()

    def run(func):
        def translated():
            try:
                return func()
            except Exception as err:  # noqa: BLE001 - anything not a user's error is Hydra's to report
                line = one_line(err, sys.argv[1:])
                if line is None:
                    raise
                refused_sweep_dirs(started, sys.argv[1:])
                print(f"error: {line}", file=sys.stderr)
                sys.exit(2)
        return run_and_report(translated)
    return run


def arguments_in_one_line(get_args_parser):
    """Hydra's command-line parser, with a flag it rejects (an unknown one, ``-m`` after the overrides) reported in
    one line, exit 2, instead of its usage text."""
    def parser():
        made = get_args_parser()

        def error(message: str):
            print(f"error: run.py: {message}; flags (-m, --cfg, --help) go before the overrides: "
                  f"python run.py [-m] key=value ... (see python run.py --help)", file=sys.stderr)
            sys.exit(2)
        made.error = error
        return made
    return parser
