"""RULER's scores with their intervals, for the report's figures: per run and length, the mean over tasks and its
95 % bootstrap interval (samples resampled within each task), and the paired difference of each perturbation run
to its attention-only run at that length (the significance rows)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .significance import RESAMPLES, SEED, identity, paired_bootstrap, run_scores, strata_of

COLUMNS = ["run_dir", "model", "setting", "method", "selection", "budget", "length", "n", "score", "ci_low", "ci_high"]


def plain(run_dir: Path) -> bool:
    """A run of the plain comparison: the default conventions and a selection without changed knobs (the knob
    ablation's other readings have their own figure)."""
    run = identity(run_dir)
    return not run.method_knobs and (not run.reads_selection or not run.knobs("selection"))


def score_intervals(run_dirs: list[Path], resamples: int = RESAMPLES, seed: int = SEED) -> pd.DataFrame:
    rows = []
    for run_dir in run_dirs:
        run = identity(run_dir)
        scores = run_scores(run_dir)
        values = scores["score"].to_numpy(dtype=float)
        for length in sorted(set(scores["length"])):
            interval = paired_bootstrap(values, strata_of(scores, length=length), resamples, seed)
            rows.append({"run_dir": str(run_dir), "model": run.cfg.model.name, "setting": run.setting,
                         "method": run.cfg.method.name, "selection": run.selection_label,
                         "budget": run.cfg.budget if run.reads_budget else None, "length": int(length),
                         "n": int(sum(len(s) for s in strata_of(scores, length=length))), "score": interval.delta,
                         "ci_low": interval.ci_low, "ci_high": interval.ci_high})
    return pd.DataFrame(rows, columns=COLUMNS)


def length_deltas(tested: pd.DataFrame | None) -> pd.DataFrame:
    """The significance rows of each length's mean (``mean_<length>``), with the length as a column."""
    if tested is None or tested.empty:
        return pd.DataFrame(columns=["run_dir", "length", "delta", "ci_low", "ci_high"])
    rows = tested[tested["domain"].astype(str).str.startswith("mean_") & tested["n"].notna()].copy()
    rows["length"] = rows["domain"].str.removeprefix("mean_").astype(int)
    return rows[["run_dir", "length", "delta", "ci_low", "ci_high"]]
