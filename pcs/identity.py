"""A run's identity, defined once from its config: the folder it writes, the config it saves, how
tables, plots, significance rows and AlpacaEval's leaderboard name it, and what pairs it with other runs.

A run reads the run-level ``budget``, ``selection`` and ``profile`` only where its method and its benchmark
both declare them (``_uses_``, see ``pcs.config``): the full cache reads none, StreamingLLM and LaProx no
selection and no profile, and the perturbation analysis compares the selections it lists itself. A
profile other than the default, or a changed convention, is part of the method's knobs. What a run does
not read is left out of everything here, so cells that differ only in it are one run.
Works on a composed config and on a run folder's saved ``config.yaml`` alike.
"""
from __future__ import annotations

import json
from functools import cached_property

from omegaconf import DictConfig, OmegaConf

from . import budget
from .config import declared, default_option, group_file, is_declaration, uses

# Where files live and which device runs: not part of what a run measures, so not in its name
# (config.yaml keeps them).
NOT_IN_NAME = {"name", "path", "cache_dir", "device", "device_map", "data_dir", "data_file", "haystack_dir", "qa_dir"}
LOCATIONS = NOT_IN_NAME - {"name"}      # a run rerun from other paths or on other devices is the same run


def without_locations(saved: dict) -> dict:
    """A saved config's data without each group's ``LOCATIONS``: what two configs of one run folder must share."""
    return {key: {k: v for k, v in value.items() if k not in LOCATIONS} if isinstance(value, dict) else value
            for key, value in saved.items()}
# Where results go, who watches and how answers decode (metrics.json records the engine): not saved with the run.
NOT_SAVED = ("results_dir", "progress", "logger", "engine")
# What is chosen from a prefill and how the answer decodes: runs that differ only in these see the same
# samples and the same prefill of each (the model and benchmark settings are equal).
PER_CELL = ("method", "selection", "profile", "budget", "compress")


def knob_text(value) -> str:
    if isinstance(value, list):
        return "+".join(map(knob_text, value))
    return str(value).replace(" ", "").replace("/", "-")


class RunIdentity:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    def declares(self, group: str, setting: str) -> bool:
        return uses(group, self.cfg[group].name, setting)

    @cached_property
    def reads_budget(self) -> bool:
        return self.declares("method", "budget") and self.declares("benchmark", "budget")

    @cached_property
    def reads_selection(self) -> bool:
        return self.declares("method", "selection") and self.declares("benchmark", "selection")

    @cached_property
    def reads_profile(self) -> bool:
        """Saved configs from before profiles existed have none: the default's conventions applied."""
        return "profile" in self.cfg and self.declares("method", "profile") and self.declares("benchmark", "profile")

    @cached_property
    def judging_keys(self) -> list[str]:
        """Benchmark knobs that judge outputs without changing them (AlpacaEval's judge)."""
        return list(declared("benchmark", self.cfg.benchmark.name, "judging", []))

    def knobs(self, group: str) -> list[str]:
        """``key=value`` for each knob of a group that differs from its option's file."""
        default = OmegaConf.to_container(group_file(group, self.cfg[group].name))
        current = OmegaConf.to_container(self.cfg[group], resolve=True)
        skip = NOT_IN_NAME | set(self.judging_keys if group == "benchmark" else ())
        return [f"{k}={knob_text(current[k])}" for k in sorted(current)
                if k not in skip and not is_declaration(k) and k in default and current[k] != default[k]]

    @cached_property
    def profile_knobs(self) -> list[str]:
        """``profile=<name>`` unless it is the default, and each convention changed from the profile's file."""
        if not self.reads_profile:
            return []
        name = self.cfg.profile.name
        return ([f"profile={name}"] if name != default_option("profile") else []) + self.knobs("profile")

    @cached_property
    def method_knobs(self) -> list[str]:
        """The method's changed knobs and its conventions (``profile_knobs``)."""
        return self.knobs("method") + self.profile_knobs

    @cached_property
    def setting_knobs(self) -> list[str]:
        """Non-default model and benchmark knobs and the decoding-time trigger: what sets a run apart
        from the other runs of any method beyond selection and budget."""
        knobs = self.knobs("model") + self.knobs("benchmark")
        trigger = self.cfg.get("compress", {}).get("trigger")
        return knobs + ([f"trigger={trigger}"] if trigger is not None else [])

    @cached_property
    def selection_label(self) -> str:
        """The selection and its non-default knobs (``perturbation_alpha=0``), or ``none``."""
        if not self.reads_selection:
            return "none"
        return "_".join([self.cfg.selection.name] + self.knobs("selection"))

    @cached_property
    def leaf(self) -> str:
        """``<method>_<selection>_b<budget>[_knob=value...]``; ``full`` reads no budget, and a benchmark
        that compares selections itself has no selection in the name."""
        method = self.cfg.method.name
        if not self.reads_budget:
            leaf = method
        elif not self.declares("benchmark", "selection"):
            leaf = f"{method}_b{self.cfg.budget}"
        else:
            selection = self.cfg.selection.name if self.reads_selection else "none"
            leaf = f"{method}_{selection}_b{self.cfg.budget}"
        groups = ["model", "method", "benchmark"] + (["selection"] if self.reads_selection else [])
        knobs = [kv for g in groups for kv in self.knobs(g)] + self.profile_knobs
        trigger = self.cfg.get("compress", {}).get("trigger")
        if trigger is not None:
            knobs.append(f"trigger={trigger}")
        return "_".join([leaf] + knobs)

    @cached_property
    def folder(self) -> str:
        """The run folder, relative to ``results_dir``."""
        return f"{self.cfg.benchmark.name}/{self.cfg.model.name}/{self.leaf}"

    @property
    def title(self) -> str:
        """How a plot names the run: ``<model> / <leaf>``."""
        return f"{self.cfg.model.name} / {self.leaf}"

    @cached_property
    def table(self) -> str | None:
        """The report table the run's scores go to: benchmark, method and every knob other than selection
        and budget (entries, or a share of each prompt: a table of its own), so that a table's cells differ only
        in those (None for a run without budget: the full cache joins every table of its benchmark and setting)."""
        if not self.reads_budget:
            return None
        share = ["share"] if budget.is_share(self.cfg.budget) else []   # a share of each prompt: its own curve
        return "_".join([self.cfg.benchmark.name, self.cfg.method.name] + share + self.method_knobs + self.setting_knobs)

    @property
    def setting(self) -> str:
        return "_".join(self.setting_knobs)

    @property
    def protocol(self) -> str | None:
        """Where the run's questions come, in words: ``question inside`` the compressed prompt, ``question after
        compression``, and with follow-ups ``+ N follow-ups after compression``; None for a benchmark without a
        question apart (AlpacaEval, the perturbation analysis). Runs of two protocols answer other questions of
        the cache, so no table ranks them together."""
        bench = self.cfg.benchmark
        if "query_aware" not in bench:
            return None
        first = "question inside" if bench.query_aware else "question after compression"
        n = bench.get("follow_up", 0)
        return f"{first} + {n} follow-up{'s' if n > 1 else ''} after compression" if n else first

    @property
    def variant(self) -> str:
        """What sets the run apart beyond method, selection and budget (its method's knobs included)."""
        return "_".join(self.method_knobs + self.setting_knobs)

    @cached_property
    def generator(self) -> str:
        """AlpacaEval's leaderboard name: model, method, selection and budget where read, other knobs."""
        parts = [self.cfg.model.name, self.cfg.method.name]
        parts += [self.selection_label] if self.reads_selection else []
        parts += [f"b{self.cfg.budget}"] if self.reads_budget else []
        return "-".join(parts + self.method_knobs + self.setting_knobs)

    def saved_data(self) -> dict:
        """The resolved config without what cannot change the results: where results go, the progress
        bar, the tracker, how outputs are judged, declarations, and the budget or selection the run does
        not read. Two requests for the same run folder give the same data."""
        data = OmegaConf.to_container(self.cfg, resolve=True)
        for key in NOT_SAVED:
            data.pop(key, None)
        for key in self.judging_keys:
            data["benchmark"].pop(key, None)
        for group in ("model", "method", "selection", "profile", "benchmark"):
            for key in [k for k in data.get(group, {}) if is_declaration(k)]:
                del data[group][key]
        if not self.reads_selection:
            data.pop("selection", None)
        if not self.reads_profile:
            data.pop("profile", None)
        if not self.reads_budget:
            data.pop("budget", None)
        return data

    @property
    def saved_config(self) -> str:
        """``config.yaml``'s text."""
        return OmegaConf.to_yaml(OmegaConf.create(self.saved_data()))

    @cached_property
    def pairing_key(self) -> str:
        """Equal for runs that differ only in selection: such runs score the same samples with the same
        cache size, and are compared sample by sample."""
        data = self.saved_data()
        data.pop("selection", None)
        return json.dumps(data, sort_keys=True)

    @cached_property
    def prefill_key(self) -> str:
        """Equal for runs that differ only in ``PER_CELL`` settings: a sweep runs such cells as one group,
        which loads the model once and prefills each sample once for all of them (``pcs.runner.run_cells``)."""
        data = self.saved_data()
        for key in PER_CELL:
            data.pop(key, None)
        return json.dumps(data, sort_keys=True)
