"""The config tree, what its options declare, and the checks of a run's knobs that ``pcs.validation`` puts
together before any model loads.

The Hydra tree ships inside the package (``pcs/conf``), so an installed pcs finds it from any folder.
A group option's file (``method/snapkv.yaml``, ``benchmark/needle.yaml``, ...) holds two kinds of keys:

- knobs (plain names): overridable, and part of a run's name when they differ from the file;
- declarations (``_name_``): what the option is, read by pcs, never a knob and never saved with a run:
  ``_target_`` the class implementing it (``module.Class``); ``_uses_`` the run-level settings it reads
  (``budget``, ``selection``: a run reads one only if its method and its benchmark both declare it);
  ``_judging_`` (benchmarks) knobs that decide how outputs are judged, not what is generated;
  ``_choices_``, ``_range_`` and ``_types_`` the values a knob may take (checked before torch loads; a knob's
  type is its default's unless ``_types_`` says);
  ``_prefill_only_`` (methods) true where it chooses from a prefill only, never again while decoding.

Declarations are looked up in the option's file by name, so a run folder's saved config (knobs only)
is enough to name, label and rescore it. Every message names the offending value and what would do.
"""
from __future__ import annotations

import copy
import functools
import importlib
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from .budget import is_share
from .errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent / "conf"
DTYPES = ("float32", "bfloat16", "float16")


# Knobs added to an option after runs were saved, each with the value that reproduces what a run saved
# without it did. A saved config that lacks one reads as if it held that value (``upgraded``), so old runs
# keep their folder, resume, and pair with new ones.
# Runs saved before a method had a scorer ranked by the window's attention, and before it had ``scorer_epsilon``
# added none; before profiles had ``l1_norm`` every
# profile summed |v W^O_h| as ``abs_sum`` does, and before ``window_cut`` every profile cut a window's prefix
# ``apart`` (kvpress's profile now sums in torch.norm's order and cuts ``in_row``, another run, so its older runs
# are not upgraded: they keep their folders and are refused as another run's config on resume). ``kvzip_count``
# changes KVzip's entries alone, so every profile's older runs read as holding their profile's value.
ADDED_KNOBS = {("benchmark", "needle"): {"query_aware": True, "follow_up": 0}, ("benchmark", "ruler"): {"follow_up": 0},
               **{("method", m): {"scorer": "window_attention", "scorer_epsilon": 0.0}
                  for m in ("snapkv", "adakv", "pyramidkv")},
               ("method", "expected_attention"): {"scorer_epsilon": 0.0},
               **{("profile", p): {"l1_norm": "abs_sum", "window_cut": "apart", "kvzip_count": "exact"}
                  for p in ("paper", "adakv", "kvcache_factory")},
               ("profile", "kvpress"): {"kvzip_count": "ratio"}}


def upgraded(saved: DictConfig) -> DictConfig:
    """A run folder's saved config with the knobs added since (``ADDED_KNOBS``) at their old behaviour, in
    the order of the option's file (so it saves as a run composed today does)."""
    for (group, option), knobs in ADDED_KNOBS.items():
        section = saved.get(group)
        if section is None or section.get("name") != option or all(k in section for k in knobs):
            continue
        values = {**knobs, **OmegaConf.to_container(section)}
        ordered = {k: values.pop(k) for k in group_file(group, option) if k in values}
        saved[group] = {**ordered, **values}
    return saved


def compose(overrides=()) -> DictConfig:
    """The run config for command-line style ``overrides``, composed as ``python run.py`` would.
    Inside a running Hydra app (``run.py``), Hydra's own loader composes it. Elsewhere (the report, the bench,
    projections, tests) the same cells are composed many times, and Hydra takes a tenth of a second or more for
    each: the overrides that choose options (``method=snapkv``) are composed once while the config tree's files
    are unchanged, and those that set a value (``budget=256``) are applied to a copy of it by Hydra's own step
    for them (``values_set``), which Hydra also applies after building the defaults, so the two give one config
    (``tests/test_configs.py`` holds them equal)."""
    from hydra.core.global_hydra import GlobalHydra
    if GlobalHydra.instance().is_initialized():
        from hydra import compose as hydra_compose
        return hydra_compose(config_name="config", overrides=list(overrides))
    choices, values = split_overrides(overrides)
    cfg = copy.deepcopy(_composed(tuple(choices), _tree_state()))
    values_set(cfg, values)
    return cfg


def split_overrides(overrides) -> tuple[list[str], list]:
    """``overrides`` as those left to Hydra's composition (option choices, and anything else than a plain
    ``key=value``) and the parsed plain ``key=value`` overrides of keys that are no config group."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    choices, values = [], []
    for line, override in zip(overrides, OverridesParser.create().parse_overrides(list(overrides))):
        key = override.key_or_group
        plain = not (override.is_sweep_override() or override.is_add() or override.is_force_add()
                     or override.is_delete() or override.package is not None or isinstance(override.value(), dict))
        if plain and not key.startswith("hydra") and not (CONF_DIR / key).is_dir():
            values.append(override)
        else:
            choices.append(line)
    return choices, values


def values_set(cfg: DictConfig, values: list) -> None:
    """Hydra's own application of ``key=value`` overrides to a composed config (its loader's last step)."""
    if values:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)


def _tree_state() -> tuple:
    """The config tree's files and their modification times: a composition is reused only while they hold."""
    return tuple(sorted((str(p), p.stat().st_mtime_ns) for p in CONF_DIR.rglob("*.yaml")))


@functools.lru_cache(maxsize=512)
def _composed(overrides: tuple, tree_state: tuple) -> DictConfig:
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def options(group: str) -> list[str]:
    """The options of a config group (``method``, ``selection``, ``benchmark/judge``, ...)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def default_option(group: str) -> str | None:
    """The option a group takes when the command line names none (config.yaml's defaults list)."""
    for entry in _read_only(CONF_DIR / "config.yaml").defaults:
        if isinstance(entry, DictConfig) and group in entry:
            return entry[group]
    return None


def group_file(group: str, name: str) -> DictConfig:
    """The file of one option of a group, as written (declarations and default knobs); read-only, as it is read
    once per process (a sweep's checks ask for the same files once per run)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"{group}={name!r} is not an option; choose one of: {', '.join(options(group))}")
    return _read_only(path)


@functools.cache
def _read_only(path: Path) -> DictConfig:
    node = OmegaConf.load(path)
    OmegaConf.set_readonly(node, True)
    return node


def is_declaration(key: str) -> bool:
    return key.startswith("_") and key.endswith("_")


def declared(group: str, name: str, key: str, default=None):
    """The ``_key_`` declaration of a group option."""
    return group_file(group, name).get(f"_{key}_", default)


def uses(group: str, name: str, setting: str) -> bool:
    """Whether a group option declares that it reads the run-level ``setting`` (budget, selection)."""
    return setting in declared(group, name, "uses", [])


def knobs(node: DictConfig) -> dict:
    """A group node's knobs (resolved), without its name and declarations."""
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items()
            if k != "name" and not is_declaration(k)}


def load_class(group: str, name: str) -> type:
    """The class a group option declares as its ``_target_``."""
    target = declared(group, name, "target")
    if not target:
        raise ConfigError(f"{group}/{name}.yaml declares no _target_ (the class that implements it)")
    module, _, cls = target.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, allowed))}")


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_method_knobs(cfg: DictConfig) -> None:
    """The method's node holds only its own knobs (a preset or an experiment may set knobs another method has),
    a preset wraps the method (``_preset_`` is left set where ``conf/preset_press/`` has no file for it), and a
    budget that reads an observation window or sinks can hold them: torch-free, before anything heavy."""
    name = cfg.method.name
    preset = cfg.method.get("_preset_")
    if preset:
        takes = sorted(p.stem.removeprefix(f"{preset}_") for p in (CONF_DIR / "preset_press").glob(f"{preset}_*.yaml"))
        own = (f"; method={name} takes selection=perturbation or perturbation_released itself"
               if uses("method", name, "selection") else "")
        raise ConfigError(f"preset={preset} wraps the method's kvpress press in CriticalKVPress, which takes a "
                          f"ScorerPress, and method={name} has none it wraps; methods it takes: {', '.join(takes)}{own}")
    own = group_file("method", name)
    foreign = sorted(k for k in cfg.method if k not in own and not is_declaration(k))
    if foreign:
        fits = [m for m in options("method") if all(k in group_file("method", m) for k in foreign)]
        raise ConfigError(f"method={name} has no knob {', '.join(foreign)} (set by a preset, an experiment or the "
                          f"command line); methods that have {'it' if len(foreign) == 1 else 'them'}: "
                          f"{', '.join(fits) or 'none'}")
    check_knob_values("method", cfg.method)
    if not uses("method", name, "budget"):
        return
    check_room(cfg.budget, cfg.method.get("window"), cfg.method.get("sinks") or 0)


TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "list": (list,), "dict": (dict,), "null": (type(None),)}


def type_of(value) -> str:
    """A knob's value's type as a config file names it (``null``, ``bool``, ``int``, ``float``, ``str``, ``list``,
    ``dict``)."""
    if value is None:
        return "null"
    if isinstance(value, ListConfig):
        return "list"
    if isinstance(value, DictConfig):
        return "dict"
    for name in ("bool", "int", "float", "str", "list"):
        if isinstance(value, TYPES[name]) and not (name == "int" and isinstance(value, bool)):
            return name
    return "dict"


def allowed_types(own: DictConfig, key: str) -> list[str] | None:
    """What a knob may hold: its ``_types_`` declaration, else its default's type (a float knob takes an integer
    too); None where neither says (a null default, a nested node)."""
    declared_types = (own.get("_types_") or {}).get(key)
    if declared_types is not None:
        return ["null" if t is None else t for t in declared_types]      # YAML reads a bare null as None
    default = type_of(own.get(key))
    return None if default in ("null", "dict") else [default]


def check_knob_values(group: str, node: DictConfig) -> None:
    """A group node's knobs against what its option's file declares they may take, torch-free, so that no value
    reaches a model to crash it: each knob's type (``_types_``, else its default's: ``window=abc`` is refused where
    the file says ``window: 32``), a list the file fills is never empty, ``_choices_`` (knob: the allowed values)
    and ``_range_`` (knob: [low, high], inclusive, high null for none; a list's every number). The classes built
    from the node take these as given (``pcs.eviction.build`` checks them too)."""
    own = group_file(group, node.name)
    for key in [k for k in own if not is_declaration(k) and k in node and k != "name"]:
        value, types = node.get(key), allowed_types(own, key)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if types is not None and not any(isinstance(value, TYPES[t]) and not (t in ("int", "float") and
                                                                             isinstance(value, bool))
                                         for t in types if t in TYPES):
            raise ConfigError(f"{group}.{key}={value!r} must be {' or '.join(TYPE_WORDS.get(t, t) for t in types)} "
                              f"({group}/{node.name}.yaml)")
        if isinstance(value, list) and not value and own.get(key):
            raise ConfigError(f"{group}.{key}=[] is empty: give at least one value (default "
                              f"{OmegaConf.to_container(own[key])})")
    for key, allowed in (own.get("_choices_") or {}).items():
        one_of(f"{group}.{key}", node.get(key), list(allowed))
    for key, (low, high) in (own.get("_range_") or {}).items():
        value = node.get(key)
        if value is None and "null" in (allowed_types(own, key) or []):
            continue
        listed = isinstance(value, ListConfig)
        bound = f"lie in [{low}, {high}]" if high is not None else f"be at least {low}"
        for number in OmegaConf.to_container(value) if listed else [value]:
            if isinstance(number, bool) or not isinstance(number, (int, float)) or number < low or \
                    (high is not None and number > high):
                shown = f"{OmegaConf.to_container(value)} holds {number!r}: each value must" if listed else \
                    f"{value!r} must"
                raise ConfigError(f"{group}.{key}={shown} {bound}")


TYPE_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string", "list": "a list", "dict": "a mapping ({key: value})",
              "null": "null"}


def check_room(budget: int | float, window: int | None = None, sinks: int = 0) -> None:
    """The budget must hold the observation window (if the method has one), and the sinks beside it (a share of
    each prompt holds them by construction: ``pcs.budget.entries``)."""
    if is_share(budget):
        return
    if window is not None and not 0 <= window <= budget:
        raise ConfigError(f"budget={budget} cannot hold the observation window method.window={window}; "
                          f"use budget >= {window} or a smaller window")
    if not 0 <= sinks <= budget - (window or 0):
        raise ConfigError(f"budget={budget} cannot hold method.sinks={sinks} attention sinks"
                          + (f" beside the window of {window}" if window else ""))


def check_named_selection(cfg: DictConfig, overrides: list[str]) -> None:
    """A selection named on the command line of one run (``selection=``, ``selection.<knob>=``) for a method that
    takes none would be silently ignored: refused, naming what the method takes. A sweep over selections runs such a
    method once and is not refused."""
    named = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == "selection"]
    if named and not uses("method", cfg.method.name, "selection"):
        takes = ", ".join(declared("method", cfg.method.name, "uses", [])) or "nothing of budget, selection and profile"
        raise ConfigError(f"{named[0]}: method={cfg.method.name} ranks by its own rule and takes no selection (it "
                          f"takes: {takes}); leave selection unset, or use a method that takes one (snapkv, adakv, "
                          f"pyramidkv or a scorer)")
