"""RULER figures, one per model and setting, with 95 % intervals: at one context length, bars of the mean score over
tasks per budget and selection (the full cache a dashed line where it ran), each perturbation bar labelled with its paired
difference to attention-only selection; at several lengths, the score against length, one panel per budget."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .labels import wrapped  # noqa: E402

# A selection's line and marker (the marker tells the selections apart where lines overlap).
STYLES = {"attention": ("-", "o"), "perturbation": ("--", "^")}   # other selections: dotted, squares
SELECTION_ORDER = ["attention", "perturbation"]


def ordered_selections(labels) -> list[str]:
    return sorted(set(labels), key=lambda s: (SELECTION_ORDER.index(s) if s in SELECTION_ORDER else 9, s))


def errors(frame: pd.DataFrame):
    return [frame["score"] - frame["ci_low"], frame["ci_high"] - frame["score"]]


def ruler_figure(scores: pd.DataFrame, deltas: pd.DataFrame, path: Path, title: str, knobs: list[str] = ()
                 ) -> Path | None:
    """``scores``: rows of ``pcs.report.ruler.score_intervals`` for one model and setting; ``deltas``: the paired
    differences by run folder and length; the title, then the setting's ``knobs`` in lines the figure's width
    holds. None if no run has a budget."""
    compressed = scores[scores["budget"].notna()]
    if compressed.empty:
        return None
    full = scores[scores["budget"].isna()]
    if scores["length"].nunique() == 1:
        fig = bars(compressed, full, deltas)
    else:
        fig = lines(compressed, full)
    fig.suptitle(wrapped([title, *knobs], int(12 * fig.get_figwidth())), fontsize=9)
    handles, labels = fig.axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=7, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def bars(compressed: pd.DataFrame, full: pd.DataFrame, deltas: pd.DataFrame):
    """One panel per method: groups of bars per budget, one bar per selection, with the score's interval."""
    methods = sorted(compressed["method"].unique())
    selections = ordered_selections(compressed["selection"])
    fig, axes = plt.subplots(1, len(methods), figsize=(1.2 + 3.6 * len(methods), 4.4), sharey=True, squeeze=False,
                             layout="constrained")
    width = 0.8 / len(selections)
    for ax, method in zip(axes[0], methods):
        mine = compressed[compressed["method"] == method]
        budgets = sorted(mine["budget"].unique())
        for i, selection in enumerate(selections):
            rows = mine[mine["selection"] == selection].set_index("budget").reindex(budgets)
            xs = [b + (i - (len(selections) - 1) / 2) * width for b in range(len(budgets))]
            ax.bar(xs, rows["score"], width, yerr=errors(rows), capsize=3, color=f"C{i}", alpha=0.85,
                   label="w/o (attention)" if selection == "attention" else
                   "w/ (perturbation)" if selection == "perturbation" else selection)
            for x, (_, row) in zip(xs, rows.iterrows()):
                hit = deltas[(deltas["run_dir"] == row.get("run_dir")) & (deltas["length"] == row.get("length"))]
                if selection != "attention" and not hit.empty:
                    d = hit.iloc[0]
                    # no interval (too few samples per stratum): the difference alone, at the bar's top
                    interval = "" if pd.isna(d["ci_low"]) else f"\n[{d['ci_low']:+.1f}, {d['ci_high']:+.1f}]"
                    top = row["score"] if pd.isna(row["ci_high"]) else row["ci_high"]
                    ax.annotate(f"{d['delta']:+.1f}{interval}", (x, top),
                                textcoords="offset points", xytext=(0, 3), ha="center", fontsize=6)
        for _, row in full.iterrows():
            ax.axhline(row["score"], color="black", linestyle="--", lw=1, label="full cache")
            if not pd.isna(row["ci_low"]):
                ax.axhspan(row["ci_low"], row["ci_high"], color="black", alpha=0.08)
        ax.set_xticks(range(len(budgets)))
        ax.set_xticklabels([f"{b:g}" for b in budgets])
        ax.set_xlabel("budget" + (" (share of each prompt)" if max(budgets) < 1 else " (entries per KV head)"))
        ax.set_title(f"{method}, {int(mine['length'].iloc[0])} tokens", fontsize=9)
        ax.set_ylim(0, 112)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel(score_label(compressed))
    return fig


def lines(compressed: pd.DataFrame, full: pd.DataFrame):
    """One panel per budget: the score against length per method and selection, with intervals."""
    budgets = sorted(compressed["budget"].unique())
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 4.2), sharey=True, squeeze=False,
                             layout="constrained")
    methods = sorted(compressed["method"].unique())
    colors = {m: plt.cm.tab10(i) for i, m in enumerate(methods)}
    for ax, budget in zip(axes[0], budgets):
        for _, run in full.groupby("run_dir"):
            run = run.sort_values("length")
            ax.errorbar(run["length"], run["score"], yerr=errors(run), color="black", linestyle=":", marker="o",
                        capsize=2, label="full cache")
        mine = compressed[compressed["budget"] == budget]
        for (method, selection), run in sorted(mine.groupby(["method", "selection"])):
            run = run.sort_values("length")
            line, marker = STYLES.get(selection, (":", "s"))
            ax.errorbar(run["length"], run["score"], yerr=errors(run), color=colors[method], linestyle=line,
                        marker=marker, capsize=2, label=f"{method} / {selection}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(compressed["length"].unique()))
        ax.set_xticklabels([f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in sorted(compressed["length"].unique())])
        ax.set_title(f"budget {budget:g}", fontsize=9)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylim(-5, 108)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(score_label(compressed))
    return fig


def score_label(scores: pd.DataFrame) -> str:
    """The y axis: says "95 % interval" only where the figure draws some (none below 10 samples per stratum)."""
    return "RULER mean over tasks" + (" (95 % interval)" if scores["ci_low"].notna().any() else "")
