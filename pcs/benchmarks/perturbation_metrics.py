"""Aggregate per-context perturbation measurements into the run's metrics (paper Section 5).

Head-wise values are averaged over contexts per (layer, query head) before comparing selections,
so each head counts once, as in the paper's Figure 2 ("lower perturbation in 819 of 1024 heads").
"""
from __future__ import annotations

import warnings

import numpy as np


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
