"""Eviction methods. Each lives in its own module and is named by its config file
(``pcs/conf/method/<name>.yaml``: ``_target_`` its class, plain keys its knobs, ``_uses_`` the
run-level settings it takes: budget, selection, profile), so adding one touches no other file; see
base.py for the interface and conventions.py for the profile's conventions."""
from __future__ import annotations

import inspect

from ..config import check_knob_values, knobs, load_class, uses
from ..errors import ConfigError
from .conventions import Conventions


def build(group: str, node, **extra):
    """The class a group option declares, built from the node's knobs (checked against the file's
    declarations) and ``extra``."""
    check_knob_values(group, node)
    cls, arguments = load_class(group, node.name), {**knobs(node), **extra}
    try:
        inspect.signature(cls).bind(**arguments)
    except TypeError as err:   # a knob the class does not take, or one it needs
        raise ConfigError(f"{group}={node.name}: {err}") from None
    return cls(**arguments)


def build_selection(selection_cfg):
    """The selection rule of a ``selection`` group node."""
    return build("selection", selection_cfg)


def build_method(cfg):
    """The method of a run config: its class built from the ``method`` node's knobs, plus the budget
    and the selection where the method declares it takes them. Bad knobs raise ``ConfigError``."""
    extra = {}
    if uses("method", cfg.method.name, "budget"):
        extra["budget"] = cfg.budget
    if uses("method", cfg.method.name, "selection"):
        extra["selection"] = build_selection(cfg.selection)
    if uses("method", cfg.method.name, "profile"):
        extra["conventions"] = Conventions(**knobs(cfg.profile))
    return build("method", cfg.method, **extra)
