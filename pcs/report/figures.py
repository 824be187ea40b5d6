"""Report figures: score vs budget with the budget savings marked (paper Figure 1), and the needle
test's depth x length heatmaps, per run and as a grid of methods with and without selection (Figure 8)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from .collect import selection_label  # noqa: E402

STYLE = {"attention": "-", "perturbation": "--"}


def savings_plot(df: pd.DataFrame, saved: pd.DataFrame, path: Path) -> Path:
    """One panel per method: average score vs budget, both selections per model, savings as arrows."""
    avg = df[(df["domain"] == "average") & df["budget"].notna() & df["selection"].isin(list(STYLE))]
    methods = list(dict.fromkeys(avg["method"]))
    fig, axes = plt.subplots(1, len(methods), figsize=(5.2 * len(methods), 4.2), squeeze=False)
    colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(avg["model"]))}
    for ax, method in zip(axes[0], methods):
        for (model, selection), g in avg[avg["method"] == method].groupby(["model", "selection"], sort=False):
            g = g.drop_duplicates("budget").sort_values("budget")
            ax.plot(g["budget"], g["score"], STYLE[selection], marker="o", color=colours[model],
                    label=f"{model}, {'w/' if selection == 'perturbation' else 'w/o'} perturbation selection")
        for _, row in saved[(saved["method"] == method) & saved["equivalent_budget"].notna()].iterrows():
            ax.annotate("", xy=(row["equivalent_budget"], row["score"]), xytext=(row["budget"], row["score"]),
                        arrowprops={"arrowstyle": "->", "color": colours[row["model"]], "lw": 1})
            ax.annotate(f"{row['savings_pct']:.1f} %", (row["equivalent_budget"], row["score"]),
                        textcoords="offset points", xytext=(4, -10), fontsize=8, color=colours[row["model"]])
            low, high = row.get("equivalent_budget_ci_low"), row.get("equivalent_budget_ci_high")
            if low is not None and not pd.isna(low):     # the bootstrap interval of the equivalent budget
                eq = row["equivalent_budget"]
                ax.errorbar([eq], [row["score"]], xerr=[[max(0.0, eq - low)], [max(0.0, high - eq)]], fmt="none",
                            ecolor=colours[row["model"]], capsize=3, lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (entries per KV head)")
        ax.set_ylabel("average score")
        ax.set_title(method)
        ax.legend(fontsize=7)
    fig.suptitle("Budget attention-only selection needs to match perturbation selection\n"
                 "(arrows: savings; bars: 95 % bootstrap interval of the equivalent budget)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def needle_grid(metrics: dict) -> tuple[np.ndarray, list[int], list[int]]:
    """(depth x length) scores, with the lengths and depths in ascending order."""
    grid = metrics["grid"]
    lengths = sorted(grid, key=int)
    depths = sorted({d for cells in grid.values() for d in cells}, key=float)
    values = np.array([[grid[n].get(d, np.nan) for n in lengths] for d in depths], dtype=float)
    return values, [int(n) for n in lengths], [int(float(d)) for d in depths]


def draw_heatmap(ax, metrics: dict, title: str):
    values, lengths, depths = needle_grid(metrics)
    image = ax.imshow(values, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d} %" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{title}\naverage {metrics['score']:.1f}", fontsize=9)
    return image


def needle_heatmap(run_dir: Path, path: Path) -> Path:
    return save_heatmap(json.loads((run_dir / "metrics.json").read_text()), run_label(run_dir), path)


def save_heatmap(metrics: dict, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.8))
    fig.colorbar(draw_heatmap(ax, metrics, title), ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_label(run_dir: Path) -> str:
    return f"{Path(run_dir).parent.name} / {Path(run_dir).name}"


def needle_comparison(run_dirs: list[Path], path: Path, budget: int) -> Path | None:
    """Rows: methods; columns: without and with perturbation selection, at one budget (a method
    without selection, such as LaProx, fills the first column of its row)."""
    cells = {}
    for run_dir in run_dirs:
        cfg = OmegaConf.load(run_dir / "config.yaml")
        if cfg.method.name in ("full", "streamingllm") or cfg.budget != budget:
            continue
        cells[(cfg.method.name, selection_label(cfg))] = run_dir
    methods = list(dict.fromkeys(m for m, _ in cells))
    selections = sorted({s for _, s in cells if s != "none"}, key=lambda s: (s != "attention", s))
    if not methods or len(selections) < 2:
        return None
    fig, axes = plt.subplots(len(methods), len(selections), figsize=(4.6 * len(selections), 3.6 * len(methods)),
                             squeeze=False, constrained_layout=True)
    image = None
    for i, method in enumerate(methods):
        row = [(method, "none")] if (method, "none") in cells else [(method, s) for s in selections]
        for j, ax in enumerate(axes[i]):
            if j >= len(row) or row[j] not in cells:
                ax.axis("off")
                continue
            metrics = json.loads((cells[row[j]] / "metrics.json").read_text())
            image = draw_heatmap(ax, metrics, method if row[j][1] == "none" else f"{method}, {row[j][1]}")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="score")
    fig.suptitle(f"Needle-in-a-Haystack at budget {budget}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
