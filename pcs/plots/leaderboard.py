"""The leaderboard's figure, one per table (a model at one context length, or at its lengths together): each
method's score with its 95 % interval, one panel per budget, attention-only and perturbation selection side by side
(a method with a rule of its own: one marker), the full cache a dashed line with its interval shaded; methods in the
order of their best score."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

MARKERS = {"attention": ("o", "tab:blue", -0.15), "perturbation": ("^", "tab:orange", 0.15)}
OWN_RULE = ("s", "tab:gray", 0.0)


def leaderboard_figure(block: pd.DataFrame, path: Path, title: str) -> Path | None:
    """``block``: ``pcs.report.leaderboard`` rows of one table. None without a compressed run."""
    compressed = block[block["budget"].notna()]
    if compressed.empty:
        return None
    full = block[block["budget"].isna()]
    budgets = sorted(compressed["budget"].unique())
    methods = list(compressed.groupby("method")["score"].max().sort_values().index)
    fig, axes = plt.subplots(1, len(budgets), figsize=(2.2 + 3.4 * len(budgets), 0.9 + 0.32 * len(methods)),
                             sharey=True, squeeze=False, layout="constrained")
    for ax, budget in zip(axes[0], budgets):
        mine = compressed[compressed["budget"] == budget]
        for _, r in full.iterrows():
            ax.axvspan(r["ci_low"], r["ci_high"], color="0.85", zorder=0)
            ax.axvline(r["score"], color="0.3", linestyle="--", linewidth=1, label="full cache")
        for selection, rows in mine.groupby("selection"):
            marker, color, shift = MARKERS.get(selection, OWN_RULE)
            y = [methods.index(m) + shift for m in rows["method"]]
            ax.errorbar(rows["score"], y, xerr=[rows["score"] - rows["ci_low"], rows["ci_high"] - rows["score"]],
                        fmt=marker, color=color, markersize=5, capsize=2, linewidth=1,
                        label=selection if selection in MARKERS else "own rule")
        ax.set_title(f"budget {budget:g}", fontsize=9)
        ax.set_xlabel("score (95 % interval)", fontsize=8)
        ax.set_xlim(-2, 102)
        ax.grid(axis="x", color="0.9")
        ax.tick_params(labelsize=8)
    axes[0][0].set_yticks(range(len(methods)), methods)
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
