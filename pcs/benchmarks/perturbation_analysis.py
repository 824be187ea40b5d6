"""The perturbation analysis as a benchmark: how far each selection moves head and layer outputs at the
first decoding token, compared on the same contexts (the paper's Figures 2 to 6).

Contexts: needle-test haystacks (the needle benchmark's essays and prompt, read from different
starting points, the needle in the middle), or the first samples of a LongBench task (the paper uses
Qasper) with the official prompt and truncation. ``benchmark.selections`` lists the variants, the
first being the baseline and the second the candidate. A variant is composed from the real config
groups: ``perturbation`` (an option of the selection group, with the run's method),
``pyramidkv/perturbation`` (a method and a selection, at their defaults), ``laprox`` (a method that
takes no selection), each optionally followed by ``:key=value,...``, Hydra overrides of the variant's
last group (``perturbation:alpha=0.0``, ``laprox:scope=layer``). Every variant runs at every budget of
``benchmark.budgets`` and at ``budget``.

Per sample, the ``output_perturbation`` step records each variant's head-wise and layer-wise
perturbation. ``score`` = 100 x the share of (layer, query head) pairs where the candidate moves the
head's output less than the baseline; the run's metrics compare heads averaged over contexts, as in
the paper's Figure 2 ("lower perturbation in 819 of 1024 heads").
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ..config import compose, options, uses
from .base import Benchmark, Sample
from .longbench import LongBench
from .needle import Haystack, essay_files, haystack_data_hashes

SOURCES = ("needle", "longbench")


def replaced(cfg: DictConfig, **entries) -> DictConfig:
    """A copy of a run config with some top-level entries replaced."""
    data = OmegaConf.to_container(cfg, resolve=True)
    data.update({k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                 for k, v in entries.items()})
    return OmegaConf.create(data)


def variant_groups(label: str) -> tuple[list[tuple[str, str]], list[str]]:
    """A variant label -> its (group, option) pairs and its ``key=value`` changes to the last group."""
    spec, _, changes = str(label).partition(":")
    method, _, name = spec.rpartition("/")
    if method:
        groups = [("method", method), ("selection", name)]
    elif name in options("selection"):
        groups = [("selection", name)]
    elif name in options("method"):
        groups = [("method", name)]
    else:
        raise ValueError(f"benchmark.selections: {label!r} names no selection or method; selections: "
                         f"{', '.join(options('selection'))}; methods: {', '.join(options('method'))}")
    return groups, [c for c in changes.split(",") if c]


class PerturbationAnalysis(Benchmark):
    step = "output_perturbation"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.labels = [str(s) for s in self.cfg.selections]
        self.budgets = sorted(set(self.cfg.budgets) | {cfg.budget})
        self.longbench = None

    def variant_config(self, label: str) -> DictConfig:
        """The run's config with the groups the variant names, composed at their defaults plus its changes."""
        groups, changes = variant_groups(label)
        group, option = groups[-1]
        try:
            composed = compose([f"{g}={o}" for g, o in groups] + [f"{group}.{c}" for c in changes])
        except Exception as err:   # Hydra says which key it could not set
            reason = str(err).splitlines()[0]
            raise ValueError(f"benchmark.selections: {label!r} changes what is not a knob of {group} {option} "
                             f"({reason})") from None
        return replaced(self.run_cfg, **{g: composed[g] for g, _ in groups})

    def variants(self) -> dict:
        """(label, budget) -> run config, for every listed variant at every budget."""
        configs = {label: self.variant_config(label) for label in self.labels}
        out = {}
        for label, cfg in configs.items():
            name = cfg.method.name
            if not uses("method", name, "budget"):
                raise ValueError(f"benchmark.selections: {label!r} uses method {name}, which keeps every entry")
            if "/" in label and not uses("method", name, "selection"):
                raise ValueError(f"benchmark.selections: {label!r} uses method {name}, which takes no selection "
                                 f"(write {name})")
            for budget in self.budgets:
                out[(label, budget)] = replaced(cfg, budget=budget)
        return out

    def check(self) -> None:
        """The run's method and the analysis's own knobs; ``variants`` (called by the runner right after)
        checks every variant."""
        method = self.run_cfg.method.name
        if not uses("method", method, "selection"):
            raise ValueError(f"benchmark=perturbation compares selections of the run's method, which must take one; "
                             f"method={method} does not (use one of "
                             f"{', '.join(m for m in options('method') if uses('method', m, 'selection'))})")
        if len(self.labels) < 2 or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"benchmark.selections={self.labels}: give at least two different variants")
        if self.cfg.source not in SOURCES:
            raise ValueError(f"benchmark.source={self.cfg.source!r}; choose {' or '.join(SOURCES)}")
        if self.cfg.source == "longbench":
            longbench = compose(["benchmark=longbench"]).benchmark
            longbench.update(tasks=[self.cfg.task], limit=self.cfg.n_samples, data_dir=self.cfg.data_dir)
            self.longbench = LongBench(replaced(self.run_cfg, benchmark=longbench))
            self.longbench.check()
        else:
            essay_files(self.cfg.haystack_dir)

    def data_hashes(self) -> dict:
        if self.longbench is not None:
            return self.longbench.data_hashes()
        return haystack_data_hashes(essay_files(self.cfg.haystack_dir))

    def samples(self, tokenizer) -> list[Sample]:
        if self.longbench is not None:
            return self.longbench.samples()
        haystack = Haystack(tokenizer, essay_files(self.cfg.haystack_dir), self.cfg.needle)
        n = self.cfg.n_samples
        starts = [i * len(haystack.tokens) // n for i in range(n)]
        return [Sample(id=f"haystack{i}", max_new_tokens=1, meta={"haystack_start": start},
                       prompt=haystack.prompt(self.cfg.context_length, 50, self.cfg.question, start))
                for i, start in enumerate(starts)]

    def encode(self, sample, tokenizer, model_cfg):
        if self.longbench is not None:
            return self.longbench.encode(sample, tokenizer, model_cfg)
        return super().encode(sample, tokenizer, model_cfg)

    def score(self, row: dict) -> float:
        base, candidate = (np.array(row["headwise"][label]) for label in self.labels[:2])
        return 100 * float((candidate < base).mean())

    def metrics(self, rows: list[dict]) -> dict:
        return summarize(rows, self.labels, self.budgets, self.run_cfg.budget)

    def finish(self, rows: list[dict], metrics: dict, run_dir: Path) -> None:
        from ..plots.output_perturbation import write_figures   # matplotlib loads only here
        write_figures(metrics, run_dir)


def compare(baseline: np.ndarray, other: np.ndarray) -> dict:
    """Heads where ``other`` is lower, and the mean relative reduction ``1 - other / baseline`` over
    heads whose baseline perturbation is not zero."""
    improved = other < baseline
    moved = baseline > 0
    return {"heads_improved_frac": float(improved.mean()), "heads_improved": int(improved.sum()),
            "n_heads": int(improved.size),
            "mean_relative_reduction": float((1 - other[moved] / baseline[moved]).mean()) if moved.any() else 0.0}


def mean_over(rows: list[dict], key: str, label: str | None = None) -> np.ndarray:
    """Mean over contexts; None (a layer kept whole, so nothing to measure) stays NaN."""
    values = np.array([row[key] if label is None else row[key][label] for row in rows], dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN columns
        return np.nanmean(values, axis=0)


def share_above_half(mass: np.ndarray) -> float | None:
    valid = mass[~np.isnan(mass)]
    return float((valid > 0.5).mean()) if valid.size else None


def summarize(rows: list[dict], labels: list[str], budgets: list[int], budget: int) -> dict:
    """The run's metrics: every variant against the baseline, head by head (averaged over contexts),
    layer by layer, across budgets, and Assumption 1."""
    baseline, candidate = labels[0], labels[1]
    heads = {label: mean_over(rows, "headwise", label) for label in labels}
    comparisons = {label: compare(heads[baseline], heads[label]) for label in labels[1:]}
    mass = mean_over(rows, "assumption1")
    return {
        "score": 100 * comparisons[candidate]["heads_improved_frac"],
        "baseline": baseline, "candidate": candidate, "budget": budget,
        **comparisons[candidate],
        "comparisons": comparisons,
        "headwise_mean": {label: heads[label].tolist() for label in labels},
        "layerwise": {label: mean_over(rows, "layerwise", label).tolist() for label in labels},
        "final_layer_per_sample": {label: [row["layerwise"][label][-1] for row in rows] for label in labels},
        "final_layer_by_budget": {label: {str(b): float(np.mean([row["final_layer"][label][str(b)] for row in rows]))
                                          for b in budgets} for label in labels},
        "assumption1_frac": share_above_half(mass),
        "assumption1_frac_without_window": share_above_half(mean_over(rows, "assumption1_without_window")),
        "assumption1_mass": [[None if np.isnan(v) else float(v) for v in layer] for layer in mass],
        "next_token_agreement": {label: float(np.mean([row["next_tokens"][label] == row["next_token_full"] for row in rows]))
                                 for label in labels},
    }
