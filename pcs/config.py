"""Checks on a composed config, run before any model loads, and the run folder's name.

Every message names the offending value and what would be accepted.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .benchmarks import BENCHMARKS
from .eviction import METHODS, METHODS_WITHOUT_SELECTION, SELECTIONS
from .eviction.laprox import GQA_MODES, POOL_TARGETS, SCOPES

from . import CONF_DIR
CHOICES = {
    "method.pooling": ("max", "avg"),
    "selection.stage2_source": ("unpooled", "pooled"),
    "selection.gqa": ("mean_of_products", "product_of_means"),
    "method.gqa": GQA_MODES,
    "method.pool_on": POOL_TARGETS,
    "method.scope": SCOPES,
    "model.dtype": ("float32", "bfloat16", "float16"),
}


class ConfigError(ValueError):
    """A user-fixable config problem."""


def one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, allowed))}")


def validate(cfg: DictConfig) -> None:
    one_of("method", cfg.method.name, METHODS)
    one_of("selection", cfg.selection.name, SELECTIONS)
    one_of("benchmark", cfg.benchmark.name, tuple(BENCHMARKS))
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value is not None:
            one_of(key, value, allowed)
    budget = cfg.budget
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ConfigError(f"budget={budget!r} must be a positive integer (entries per KV head)")
    window = cfg.method.get("window")
    if window is not None and not 0 < window <= budget:
        raise ConfigError(f"budget={budget} cannot hold the observation window method.window={window}; "
                          f"use budget >= {window} or a smaller window")
    trigger = cfg.compress.trigger
    if trigger is not None and (not isinstance(trigger, int) or isinstance(trigger, bool) or trigger <= budget):
        raise ConfigError(f"compress.trigger={trigger!r} must be an integer above budget={budget} "
                          f"(or null for no decoding-time compression)")
    sinks = cfg.method.get("sinks")
    room = budget - (window or 0)
    if sinks is not None and not 0 <= sinks <= room:
        raise ConfigError(f"budget={budget} cannot hold method.sinks={sinks} attention sinks"
                          + (f" beside the window of {window}" if window else ""))
    alpha = cfg.selection.get("alpha")
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"selection.alpha={alpha} must lie in [0, 1]")
    floor = cfg.method.get("floor")
    if floor is not None and not 0.0 <= floor <= 1.0:
        raise ConfigError(f"method.floor={floor} must lie in [0, 1]")
    window, max_length = cfg.model.context_window, cfg.model.max_length
    if not isinstance(max_length, int) or not 0 < max_length <= window:
        raise ConfigError(f"model.max_length={max_length!r} must be a positive integer no larger than "
                          f"model.context_window={window}")
    lengths = cfg.benchmark.get("context_lengths") or []
    too_long = [n for n in lengths if n > window]
    if too_long:
        raise ConfigError(f"benchmark.context_lengths {too_long} exceed model.context_window={window}")
    if cfg.model.get("path") and not Path(cfg.model.path).exists():
        raise ConfigError(f"model.path={cfg.model.path!r} does not exist")


def selection_applies(cfg: DictConfig) -> bool:
    """Full cache and StreamingLLM choose no entries by score, so the selection rule is moot; the
    perturbation analysis compares the selections its own config lists."""
    return cfg.method.name not in METHODS_WITHOUT_SELECTION and BENCHMARKS[cfg.benchmark.name].uses_selection


def saved_config(cfg: DictConfig) -> str:
    """The resolved config as written to ``config.yaml``, without what cannot change the results:
    where results go, the progress bar, how outputs are judged, and the budget or selection of
    methods that ignore them.
    Two requests for the same run folder must produce the same text."""
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in ("results_dir", "progress", "logger"):   # where results go and who watches
        data.pop(key, None)
    for key in BENCHMARKS[cfg.benchmark.name].annotation_keys:   # judging settings: see pcs.annotate
        data["benchmark"].pop(key, None)
    if not selection_applies(cfg):
        data.pop("selection", None)
    if cfg.method.name == "full":
        data.pop("budget", None)
    return OmegaConf.to_yaml(OmegaConf.create(data))


# Where files live and which device runs: not part of what a run measures, so not in its name
# (config.yaml keeps them).
NOT_IN_NAME = {"name", "path", "cache_dir", "device", "device_map", "data_dir", "data_file", "haystack_dir"}


def knob_text(value) -> str:
    if isinstance(value, list):
        return "+".join(map(knob_text, value))
    return str(value).replace(" ", "").replace("/", "-")


def group_overrides(cfg: DictConfig, group: str) -> list[str]:
    """``key=value`` for each knob of a config group that differs from the group file's default."""
    node = cfg[group]
    default_file = CONF_DIR / group / f"{node.name}.yaml"
    if not default_file.exists():
        return []
    default = OmegaConf.to_container(OmegaConf.load(default_file))
    current = OmegaConf.to_container(node, resolve=True)
    skip = NOT_IN_NAME | set(BENCHMARKS[cfg.benchmark.name].annotation_keys if group == "benchmark" else ())
    return [f"{k}={knob_text(current[k])}" for k in sorted(current)
            if k not in skip and k in default and current[k] != default[k]]


def run_name(cfg: DictConfig) -> str:
    """``<benchmark>/<model>/<method>_<selection>_b<budget>[_knob=value...]`` (no selection for a
    benchmark that compares selections itself)."""
    if cfg.method.name == "full":
        leaf = "full"
    elif not BENCHMARKS[cfg.benchmark.name].uses_selection:
        leaf = f"{cfg.method.name}_b{cfg.budget}"
    else:
        selection = cfg.selection.name if selection_applies(cfg) else "none"
        leaf = f"{cfg.method.name}_{selection}_b{cfg.budget}"
    groups = ["model", "method", "benchmark"] + (["selection"] if selection_applies(cfg) else [])
    knobs = [kv for g in groups for kv in group_overrides(cfg, g)]
    if cfg.compress.trigger is not None:
        knobs.append(f"trigger={cfg.compress.trigger}")
    if knobs:
        leaf += "_" + "_".join(knobs)
    return f"{cfg.benchmark.name}/{cfg.model.name}/{leaf}"
