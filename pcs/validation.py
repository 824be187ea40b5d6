"""A run's config checked whole before any model loads, torch-free: the run-level settings and the model
(``pcs.config``'s checks), the method's knobs against its file and the budget, its scorer (``pcs.eviction.scorers``)
and its profile's conventions (``pcs.eviction.conventions``). Each method, selection and benchmark checks the rest
of its own knobs when it is built, still before the model loads."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from . import budget
from .budget import is_share
from .config import (DTYPES, check_knob_values, check_method_knobs, declared, group_file, knobs, one_of,
                     positive_int)
from .errors import ConfigError
from .eviction.conventions import Conventions
from .eviction.scorers import SCORERS
from .options import EngineOptions


def check_scorer(cfg: DictConfig) -> None:
    """A method's scorer (``pcs.eviction.scorers``) with the window it reads, and per-KV-head scores where the profile
    would have each query head choose alone (``profile.gqa=per_query_head``): nothing to choose apart by."""
    name = cfg.method.get("scorer")
    if name is None:
        return
    one_of("method.scorer", name, list(SCORERS))
    scorer, window = SCORERS[name], cfg.method.get("window")
    if name == "window_attention" and not (isinstance(window, int) and window >= 1):
        raise ConfigError(f"method={cfg.method.name} ranks the prefix by the observation window's attention: "
                          f"method.window={window} must be at least 1")
    if scorer.window is not None and window != scorer.window:
        raise ConfigError(f"method.scorer={name} reads the newest {scorer.window} entr"
                          f"{'y' if scorer.window == 1 else 'ies'}: method.window={window} must be {scorer.window}")
    if name != "window_attention" and cfg.profile.get("gqa") == "per_query_head":
        raise ConfigError(f"profile.gqa=per_query_head has each query head choose by its own attention, and "
                          f"method.scorer={name} scores per KV head: use another profile.gqa")
    if scorer.prompt and cfg.get("compress", {}).get("trigger") is not None:
        raise ConfigError(f"method.scorer={name} reads every query of the prompt, which only the prefill has: "
                          f"compress.trigger (decoding-time compression) cannot use it; set compress.trigger=null")
    epsilon = cfg.method.get("scorer_epsilon") or 0
    if epsilon and not scorer.epsilon:
        raise ConfigError(f"method.scorer_epsilon={epsilon}: method.scorer={name} adds no epsilon to its scores "
                          f"(only expected_attention does); leave it at 0")
    if scorer.sinks and not is_share(cfg.budget) and cfg.budget < scorer.sinks + (window or 0):
        raise ConfigError(f"method.scorer={name} always keeps the first {scorer.sinks} entries: budget={cfg.budget} "
                          f"must hold them")


def validate(cfg: DictConfig) -> None:
    """Checks of the run-level settings, the method's knobs against its file and the budget, and the model;
    each method, selection and benchmark checks the rest of its own knobs when it is built (still before the
    model loads)."""
    for group in ("model", "method", "selection", "profile", "benchmark"):
        group_file(group, cfg[group].name)
    one_of("model.dtype", cfg.model.dtype, DTYPES)
    budget.check(cfg.budget)
    for group in ("model", "profile", "benchmark", "logger"):
        check_knob_values(group, cfg[group])
    check_method_knobs(cfg)
    check_knob_values("selection", cfg.selection)
    check_scorer(cfg)
    Conventions(**knobs(cfg.profile))
    trigger = cfg.compress.trigger
    if trigger is not None and budget.is_share(cfg.budget):
        raise ConfigError(f"compress.trigger bounds entries per head during decoding; it needs a budget in entries, "
                          f"not budget={cfg.budget} (a share of each prompt)")
    if trigger is not None and not (positive_int(trigger) and trigger > cfg.budget):
        raise ConfigError(f"compress.trigger={trigger!r} must be an integer above budget={cfg.budget} "
                          f"(or null for no decoding-time compression)")
    if trigger is not None and declared("method", cfg.method.name, "prefill_only", False):
        raise ConfigError(f"method={cfg.method.name} chooses from a prefill only: compress.trigger (decoding-time "
                          f"compression) cannot use it; set compress.trigger=null")
    if trigger is not None and cfg.get("profile", {}).get("gqa") == "per_query_head":
        raise ConfigError("compress.trigger does not work with profile.gqa=per_query_head (a layer whose query heads "
                          "chose apart is not compressed again); use another profile.gqa or no trigger")
    engine = cfg.get("engine") or {}
    try:
        options = EngineOptions.from_config(OmegaConf.to_container(engine) if isinstance(engine, DictConfig) else engine)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"engine: {err}") from err
    search = options.stage2
    for knob in ("exhaustive_below", "loose_after"):
        if not positive_int(getattr(search, knob)):
            raise ConfigError(f"engine.stage2.{knob}={getattr(search, knob)!r} must be a positive integer")
    if isinstance(search.loose_share, bool) or not isinstance(search.loose_share, (int, float)) \
            or not 0 <= search.loose_share <= 1:
        raise ConfigError(f"engine.stage2.loose_share={search.loose_share!r} must lie in [0, 1]")
    if not all(isinstance(flag, bool) for flag in (search.value_norm_kernel, options.cuda_graphs,
                                                    options.decode_kernel, options.compile_step)):
        raise ConfigError("engine.stage2.value_norm_kernel, engine.cuda_graphs, engine.decode_kernel and "
                          "engine.compile_step must be true or false")
    if isinstance(options.layers_behind, bool) or not isinstance(options.layers_behind, int) \
            or options.layers_behind < 0:
        raise ConfigError(f"engine.layers_behind={options.layers_behind!r} must be a whole number of layers "
                          f"(0: none)")
    if engine.get("pool") is not None and not positive_int(engine.pool):
        raise ConfigError(f"engine.pool={engine.pool!r} must be a positive integer (sequences decoding together) "
                          f"or null (the device's default)")
    stop_when_scored = engine.get("stop_when_scored", False)
    if not isinstance(stop_when_scored, bool):
        raise ConfigError(f"engine.stop_when_scored={stop_when_scored!r} must be true or false")
    if stop_when_scored and not declared("benchmark", cfg.benchmark.name, "settles", False):
        raise ConfigError(f"engine.stop_when_scored=true: benchmark={cfg.benchmark.name}'s score of an answer can "
                          f"still change as the answer grows, so its answers decode to the end (only benchmarks "
                          f"declaring _settles_, such as ruler, may stop early)")
    window, max_length = cfg.model.context_window, cfg.model.max_length
    if not positive_int(max_length) or max_length > window:
        raise ConfigError(f"model.max_length={max_length!r} must be a positive integer no larger than "
                          f"model.context_window={window}")
    too_long = [n for n in cfg.benchmark.get("context_lengths") or [] if n > window]
    if too_long:
        raise ConfigError(f"benchmark.context_lengths {too_long} exceed model.context_window={window}")
    if cfg.model.get("path") and not Path(cfg.model.path).exists():
        raise ConfigError(f"model.path={cfg.model.path!r} does not exist")
