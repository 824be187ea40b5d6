"""The budget-savings plot (paper Figure 1): average score against budget, both selections per model,
the savings as arrows and their bootstrap intervals as bars."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .labels import method_knobs, setting_knobs, wrapped  # noqa: E402

STYLE = {"attention": "-", "perturbation": "--"}


def table_title(table: str, rows: pd.DataFrame) -> str:
    """The table's benchmark and method, then its knobs as a run of it lists them (the table's name where no run
    folder is behind it: the paper's numbers)."""
    runs = rows["run_dir"].dropna() if "run_dir" in rows else []
    if not len(runs):
        return "\n".join(textwrap.wrap(table.replace("_", " "), 52))
    first = rows.loc[runs.index[0]]
    knobs = method_knobs(runs.iloc[0]) + setting_knobs(runs.iloc[0])
    return wrapped([f"{first['benchmark']}, {first['method']}"] + knobs, 52)


def savings_plot(df: pd.DataFrame, saved: pd.DataFrame, path: Path) -> Path:
    """One panel per report table (benchmark, method and setting: runs that differ only in selection and
    budget): average score vs budget, both selections per model, savings as arrows."""
    avg = df[(df["domain"] == "average") & df["budget"].notna() & df["selection"].isin(list(STYLE))]
    full = df[(df["domain"] == "average") & df["budget"].isna()]
    # a curve needs two budgets: a table measured at one has no savings to draw
    tables = [t for t in dict.fromkeys(avg["table"]) if avg[avg["table"] == t]["budget"].nunique() >= 2]
    columns = min(len(tables), 3)
    rows = -(-len(tables) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.2 * rows), squeeze=False)
    colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(avg["model"]))}
    for ax, table in zip(axes.flat, tables):
        mine = avg[avg["table"] == table]
        for (model, selection), g in mine.groupby(["model", "selection"], sort=False):
            g = g.drop_duplicates("budget").sort_values("budget")
            ax.plot(g["budget"], g["score"], STYLE[selection], marker="o", color=colours[model],
                    label=f"{model}, {'w/' if selection == 'perturbation' else 'w/o'} perturbation selection")
        for _, row in saved[(saved["table"] == table) & saved["equivalent_budget"].notna()].iterrows():
            ax.annotate("", xy=(row["equivalent_budget"], row["score"]), xytext=(row["budget"], row["score"]),
                        arrowprops={"arrowstyle": "->", "color": colours[row["model"]], "lw": 1})
            ax.annotate(f"{row['savings_pct']:.1f} %", (row["equivalent_budget"], row["score"]),
                        textcoords="offset points", xytext=(4, -10), fontsize=8, color=colours[row["model"]])
            low, high = row.get("equivalent_budget_ci_low"), row.get("equivalent_budget_ci_high")
            if low is not None and not pd.isna(low):     # the bootstrap interval of the equivalent budget
                eq = row["equivalent_budget"]
                ax.errorbar([eq], [row["score"]], xerr=[[max(0.0, eq - low)], [max(0.0, high - eq)]], fmt="none",
                            ecolor=colours[row["model"]], capsize=3, lw=1)
        for model, row in full[full["table"] == table].drop_duplicates("model").set_index("model").iterrows():
            ax.axhline(row["score"], color=colours.get(model, "black"), linestyle=":", lw=1,
                       label=f"{model}, full cache")
        share = bool((mine["budget"] < 1).all())
        ax.set_xscale("log", base=2)
        budgets = sorted(mine["budget"].unique())
        ax.set_xticks(budgets)
        ax.set_xticklabels([f"{b:g}" for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("budget (share of each prompt)" if share else "budget (entries per KV head)")
        ax.set_ylabel("average score")
        ax.set_title(table_title(table, mine), fontsize=8)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(tables):]:
        ax.set_visible(False)
    fig.suptitle("Budget attention-only selection needs to match perturbation selection\n"
                 "(arrows: savings; bars: 95 % bootstrap interval of the equivalent budget, cut at the measured budgets)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
