"""The knob ablation at a glance: per method and budget, each reading's difference to attention-only selection
under its own conventions (w/ - w/o) and to the paper's knobs, with their paired 95 % intervals."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .labels import setting_knobs, wrapped  # noqa: E402

MARKERS = {"w/o": ("o", "C0", "w/ - w/o (attention, same conventions)"),
           "paper knobs": ("s", "C1", "reading - paper knobs (same conventions)"),
           "paper conventions": ("^", "C2", "reading - same selection, paper conventions")}
OFFSETS = {"w/o": -0.2, "paper knobs": 0.0, "paper conventions": 0.2}


def reading_name(conventions: str, selection: str, knobs: str) -> str:
    """``attention`` / ``paper knobs`` / the changed knobs, one per line, then the conventions where changed."""
    what = selection.split("_")[0] if not knobs else knobs.replace(", ", "\n")
    what = "paper knobs" if what == "perturbation" else what
    return what + (f"\n[{conventions}]" if conventions else "")


def ablation_plot(effects: pd.DataFrame, path: Path, domain: str = "average") -> Path | None:
    """One row of panels per (model, benchmark, setting), one panel per (method, budget); None without rows."""
    mine = effects[effects["domain"] == domain]
    if mine.empty:
        return None
    blocks = list(mine.groupby(["model", "benchmark", "setting"], sort=True))
    panels = max(len(b.groupby(["method", "budget"])) for _, b in blocks)
    heights = [max(2.5, 0.6 * b[["conventions", "selection"]].drop_duplicates().shape[0]) for _, b in blocks]
    # One x scale per row: a reader compares a reading's effect across methods and budgets at a glance.
    fig, axes = plt.subplots(len(blocks), panels, figsize=(2.5 + 3.2 * panels, sum(heights) + 1.4), squeeze=False,
                             sharex="row", gridspec_kw={"height_ratios": heights}, layout="constrained")
    for row, ((model, benchmark, setting), block) in enumerate(blocks):
        names = sorted({(c, s, k) for c, s, k in zip(block["conventions"], block["selection"], block["knobs"])})
        setting_title = wrapped(setting_knobs(block["run_dir"].iloc[0]), 40)
        y = {name[:2]: i for i, name in enumerate(names)}
        for col, ((method, budget), cells) in enumerate(block.groupby(["method", "budget"], sort=True)):
            ax = axes[row][col]
            for against, (marker, colour, label) in MARKERS.items():
                hit = cells[cells["against"] == against]
                ys = [y[(c, s)] + OFFSETS[against] for c, s in zip(hit["conventions"], hit["selection"])]
                err = [hit["delta"] - hit["ci_low"], hit["ci_high"] - hit["delta"]]
                ax.errorbar(hit["delta"], ys, xerr=err, fmt=marker, color=colour, capsize=2, ms=4, lw=1,
                            label=label if row == 0 and col == 0 else None)
            ax.axvline(0, color="black", lw=0.8)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels([reading_name(*n) for n in names] if col == 0 else [], fontsize=7)
            ax.set_ylim(-0.6, len(names) - 0.4)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
            ax.set_title(f"{model}, {method}, budget {budget}\n" + setting_title, fontsize=8)
            ax.set_xlabel("difference in score (points)", fontsize=7)
        for ax in axes[row][len(block.groupby(["method", "budget"])):]:
            ax.set_visible(False)
    fig.legend(loc="outside upper center", ncol=len(MARKERS), fontsize=7, frameon=False)   # seen first: tall
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
