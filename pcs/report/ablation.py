"""Which knob carries a selection's effect: each run of a knob ablation (``conf/ablation/``) against the runs it
differs from in one respect, sample by sample.

Runs that score the same samples with the same cache size (model, benchmark and setting, method, budget) form a
group. In a group each run is a *reading*: its conventions (the method's changed knobs and profile, ``""`` for the
default's) and its selection (the label with its changed knobs). A reading is compared with
- ``w/o``: attention-only selection under the same conventions (the selection's effect);
- ``paper knobs``: the perturbation selection with every knob at its default, same conventions (what the
  reading's knobs change);
- ``paper conventions``: the same selection under the default conventions (what the conventions change);
- one knob apart: each reading with one of this one's knobs back at its default (``without <knob>``, for a
  reading of two or more knobs) or at another value (``<knob>=<value>``), same conventions, the other knobs the
  same (what the knob, as this reading sets it, changes once the others are in), wherever the group has it.
Each difference is a paired stratified bootstrap (``significance``) on the mean over tasks: ``average`` and, for a
benchmark scored per length (RULER), the mean at each length.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..benchmarks.ruler_data import domain_name
from ..config import default_option
from .significance import (MIN_STRATUM, RESAMPLES, SEED, UnpairedError, identity, paired, paired_bootstrap, run_scores,
                           strata_of)

ATTENTION = "attention"
COMPARISONS = ("w/o", "paper knobs", "paper conventions")
COLUMNS = ["model", "benchmark", "setting", "method", "budget", "conventions", "selection", "knobs", "score", "against",
           "domain", "n", "delta", "ci_low", "ci_high", "half_width", "p_value", "note", "run_dir", "baseline_run_dir"]


@dataclass(frozen=True)
class Reading:
    run_dir: Path
    group: tuple               # (model, benchmark, setting, method, budget)
    conventions: str           # the method's changed knobs and profile, ", "-joined ("" for the default's)
    selection: str             # the selection's label (name and changed knobs)
    name: str                  # the selection's name
    knobs: tuple[str, ...]     # the selection's changed knobs, ``key=value`` each

    def baseline(self, against: str) -> tuple[str, str]:
        """(conventions, selection) of the reading this one is compared with."""
        return {"w/o": (self.conventions, ATTENTION),
                "paper knobs": (self.conventions, default_option("selection")),
                "paper conventions": ("", self.selection)}[against]

    @property
    def knob_values(self) -> dict[str, str]:
        return dict(knob.split("=", 1) for knob in self.knobs)

    def one_knob_apart(self, members: dict[tuple[str, str], Reading]) -> dict[str, Reading]:
        """The group's readings one knob away from this one, same conventions and selection, keyed by how they
        differ: ``without <key>`` where that knob of this reading's is back at its default (for a reading of two
        or more knobs: for one, that is the paper-knobs comparison), ``<key>=<value>`` where it has another
        value. Each says what the knob, as this reading sets it, changes once its other knobs are in."""
        mine, found = self.knob_values, {}
        for other in members.values():
            if other.conventions != self.conventions or other.name != self.name:
                continue
            theirs = other.knob_values
            differ = [k for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)]
            if len(differ) != 1 or differ[0] not in mine:     # not one apart, or the other sets a knob more
                continue
            knob = differ[0]
            if knob in theirs:
                found[f"{knob}={theirs[knob]}"] = other
            elif len(mine) > 1:
                found[f"without {knob}"] = other
        return found


def readings(run_dirs: list[Path]) -> dict[tuple, dict[tuple[str, str], Reading]]:
    """Groups of runs with a selection: group -> (conventions, selection) -> reading."""
    groups: dict[tuple, dict[tuple[str, str], Reading]] = {}
    for run_dir in run_dirs:
        run = identity(run_dir)
        if not run.reads_selection:
            continue
        cfg = run.cfg
        group = (cfg.model.name, cfg.benchmark.name, run.setting, cfg.method.name, cfg.budget)
        conventions = ", ".join(run.method_knobs)
        groups.setdefault(group, {})[(conventions, run.selection_label)] = Reading(
            Path(run_dir), group, conventions, run.selection_label, cfg.selection.name, tuple(run.knobs("selection")))
    return groups


def is_ablation(group: dict[tuple[str, str], Reading]) -> bool:
    """A group with a reading beyond attention-only and the default perturbation selection under the default
    conventions (the plain with/without comparison is the significance section's)."""
    plain = {("", ATTENTION), ("", default_option("selection"))}
    return bool(set(group) - plain)


def mean_domains(table: pd.DataFrame) -> dict[str, list]:
    """``average`` (every stratum) and, for a benchmark scored per length (its strata are finer than its tasks:
    RULER's task x length), each length's mean (RULER's name). LongBench's ``length`` is a sample's word count."""
    out = {"average": strata_of(table)}
    if (table["stratum"] == table["task"]).all():
        return out
    lengths = sorted({n for n in table["length"] if n is not None and n == n})
    for length in lengths:
        out[domain_name("mean", int(length))] = strata_of(table, length=length)
    return out


def run_score(run_dir: Path) -> float:
    return json.loads((Path(run_dir) / "metrics.json").read_text())["score"]


def knob_effects(run_dirs: list[Path], resamples: int = RESAMPLES, seed: int = SEED) -> pd.DataFrame:
    """One row per (reading, comparison, domain) of every ablation group, where the baseline reading exists."""
    rows = []
    scores: dict[Path, pd.DataFrame] = {}

    def scored(path: Path) -> pd.DataFrame:
        if path not in scores:
            scores[path] = run_scores(path)
        return scores[path]

    for group, members in sorted(readings(run_dirs).items(), key=lambda kv: str(kv[0])):
        if not is_ablation(members):
            continue
        model, benchmark, setting, method, budget = group
        for key, reading in sorted(members.items()):
            bases = {against: members.get(reading.baseline(against)) for against in COMPARISONS
                     # attention-only selection is the w/o itself
                     if reading.selection != ATTENTION or against == "paper conventions"}
            for against, base in {**bases, **reading.one_knob_apart(members)}.items():
                if base is None or base is reading:
                    continue
                common = {"model": model, "benchmark": benchmark, "setting": setting, "method": method,
                          "budget": budget, "conventions": reading.conventions, "selection": reading.selection,
                          "knobs": ", ".join(reading.knobs),
                          "score": run_score(reading.run_dir), "against": against,
                          "run_dir": str(reading.run_dir), "baseline_run_dir": str(base.run_dir)}
                try:
                    table = paired([scored(base.run_dir), scored(reading.run_dir)])
                except UnpairedError as err:       # reported in its row, never paired silently
                    rows.append({**common, "domain": "average", "note": f"unpaired: {err}"})
                    continue
                difference = (table[1] - table[0]).to_numpy()
                for domain, strata in mean_domains(table).items():
                    interval = paired_bootstrap(difference, strata, resamples, seed)
                    rows.append({**common, "domain": domain, **vars(interval), "note": "",
                                 "half_width": (interval.ci_high - interval.ci_low) / 2})
    return pd.DataFrame(rows, columns=COLUMNS)


def cell(rows: pd.DataFrame, against: str) -> str:
    hit = rows[rows["against"] == against]
    if hit.empty:
        return "-"
    r = hit.iloc[0]
    if isinstance(r["note"], str) and r["note"]:
        return r["note"]
    if pd.isna(r["ci_low"]):
        return f"{r['delta']:+.1f} [no interval: < {MIN_STRATUM} per stratum]"
    star = "*" if r["ci_low"] > 0 or r["ci_high"] < 0 else ""
    return f"{r['delta']:+.1f}{star} [{r['ci_low']:+.1f}, {r['ci_high']:+.1f}]"


def apart_cell(rows: pd.DataFrame) -> str:
    """A reading's differences to the readings one knob apart: ``<how they differ>: delta [interval]``,
    ``; ``-joined."""
    apart = sorted(set(rows["against"]) - set(COMPARISONS))
    return "; ".join(f"{a}: {cell(rows, a)}" for a in apart) or "-"


def n_text(rows: pd.DataFrame) -> str:
    counts = rows["n"].dropna()
    return str(int(counts.iloc[0])) if len(counts) else "-"


def blocks(effects: pd.DataFrame, domain: str = "average"):
    """``((model, benchmark, setting), rows)`` per ablation on ``domain``: the unit of one table and one figure."""
    return effects[effects["domain"] == domain].groupby(["model", "benchmark", "setting"], sort=True)


def markdown(effects: pd.DataFrame, domain: str = "average") -> list[str]:
    """One table per (model, benchmark, setting): each reading's score and its differences on ``domain``."""
    lines = []
    for (model, benchmark, setting), block in blocks(effects, domain):
        lines += [f"### {model}, {benchmark}{', ' + setting if setting else ''}", "",
                  "| method | budget | conventions | selection | score | n | vs w/o | vs paper knobs | "
                  "vs paper conventions | vs one knob apart |", "|---|---:|---|---|---:|---:|---|---|---|---|"]
        for (method, budget, conventions, selection), rows in block.groupby(
                ["method", "budget", "conventions", "selection"], sort=True):
            lines.append(f"| {method} | {budget} | {conventions or 'paper'} | {selection} | {rows['score'].iloc[0]:.1f} | "
                         f"{n_text(rows)} | {cell(rows, 'w/o')} | {cell(rows, 'paper knobs')} | "
                         f"{cell(rows, 'paper conventions')} | {apart_cell(rows)} |")
        lines.append("")
    return lines
