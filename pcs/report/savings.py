"""Budget savings (the paper's Figure 1): what budget would attention-only selection need to match
the perturbation-constrained selection's score?

The attention-only curve is linear between measured budgets. The equivalent budget of a score is
where that curve first reaches it, scanning budgets upward (so a non-monotone curve gives the
smallest budget that does as well); a score outside the curve's measured range gets no number, and
the note says on which side it lies. The saving is ``1 - b / b_equivalent``.
"""
from __future__ import annotations

import pandas as pd

BELOW, ABOVE = "below the measured range", "above the measured range"


def equivalent_budget(budgets: list[float], scores: list[float], target: float) -> tuple[float | None, str]:
    """(budget, "") where the piecewise-linear curve first reaches ``target``, else (None, why)."""
    points = sorted(zip(budgets, scores))
    for (b0, s0), (b1, s1) in zip(points, points[1:]):
        if s0 == target:
            return float(b0), ""
        if min(s0, s1) <= target <= max(s0, s1):
            return float(b0 + (target - s0) / (s1 - s0) * (b1 - b0)), ""
    if points and points[-1][1] == target:
        return float(points[-1][0]), ""
    best = max(s for _, s in points)
    return None, ABOVE if target > best else BELOW


def savings(df: pd.DataFrame, baseline: str = "attention", candidate: str = "perturbation") -> pd.DataFrame:
    """One row per (table, model, method, candidate budget) from the ``average`` rows."""
    avg = df[(df["domain"] == "average") & df["budget"].notna()]
    out = []
    for (table, model, method), group in avg.groupby(["table", "model", "method"], sort=False):
        base = group[group["selection"] == baseline].drop_duplicates("budget")
        cand = group[group["selection"] == candidate].drop_duplicates("budget").sort_values("budget")
        if len(base) < 2 or cand.empty:
            continue
        for _, row in cand.iterrows():
            eq, note = equivalent_budget(base["budget"].tolist(), base["score"].tolist(), row["score"])
            out.append({"model": model, "method": method, "budget": row["budget"], "score": row["score"],
                        "equivalent_budget": None if eq is None else round(eq, 1),
                        "savings_pct": None if eq is None else round(100 * (1 - row["budget"] / eq), 1),
                        "note": note, "table": table})
    return pd.DataFrame(out, columns=["model", "method", "budget", "score", "equivalent_budget", "savings_pct",
                                      "note", "table"])
