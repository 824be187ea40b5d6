"""RULER figure: the mean score over tasks against the context length, one line per method, selection and
budget (the full cache dashed), one panel per budget so that each panel compares selections at equal memory."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..identity import RunIdentity  # noqa: E402
from ..run_folder import load_config  # noqa: E402

# A selection's line and marker: the marker tells the selections apart where a run has one length (a point).
STYLES = {"attention": ("-", "o"), "perturbation": ("--", "^")}   # other selections: dotted, squares


def curve(run_dir: Path) -> tuple[list[int], list[float]]:
    """(lengths, mean score over tasks at each) of one finished RULER run."""
    lengths = json.loads((Path(run_dir) / "metrics.json").read_text())["lengths"]
    ordered = sorted(lengths, key=int)
    return [int(n) for n in ordered], [lengths[n]["mean"] for n in ordered]


def score_by_length(run_dirs: list[Path], path: Path, title: str) -> Path | None:
    """Score-vs-length panels of runs of one model and setting; None if no run has a budget."""
    runs = {Path(r): RunIdentity(load_config(r)) for r in run_dirs}
    budgets = sorted({run.cfg.budget for run in runs.values() if run.reads_budget})
    if not budgets:
        return None
    full = [r for r, run in runs.items() if not run.reads_budget]
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.4), sharey=True, squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for run_dir in full:
            ax.plot(*curve(run_dir), color="black", linestyle=":", marker="o", label="full cache")
        mine = sorted((run.cfg.method.name, run.selection_label, r) for r, run in runs.items()
                      if run.reads_budget and run.cfg.budget == budget)
        methods = sorted({m for m, _, _ in mine})
        colors = {m: plt.cm.tab10(i) for i, m in enumerate(methods)}
        for method, selection, run_dir in mine:
            line, marker = STYLES.get(selection, (":", "s"))
            ax.plot(*curve(run_dir), color=colors[method], linestyle=line, marker=marker,
                    label=f"{method} / {selection}")
        ax.set_title(f"budget {budget}", fontsize=9)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("RULER mean over tasks")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
