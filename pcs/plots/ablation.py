"""The knob ablation at a glance, one figure per model, benchmark and setting: per method and budget, each
reading's difference to attention-only selection under its own conventions (w/ - w/o), to the paper's knobs and to
the same selection under the paper's conventions, with their paired 95 % intervals."""
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


def ablation_figure(block: pd.DataFrame, path: Path, title: str) -> Path | None:
    """One (model, benchmark, setting)'s readings: one panel per (method, budget), sharing the x scale (a reader
    compares a reading's effect across methods and budgets at a glance). None without rows."""
    if block.empty:
        return None
    names = sorted({(c, s, k) for c, s, k in zip(block["conventions"], block["selection"], block["knobs"])})
    y = {name[:2]: i for i, name in enumerate(names)}
    cells = list(block.groupby(["method", "budget"], sort=True))
    fig, axes = plt.subplots(1, len(cells), figsize=(2.5 + 3.2 * len(cells), max(2.5, 0.6 * len(names)) + 1.6),
                             squeeze=False, sharex=True, layout="constrained")
    labelled = set()         # the legend names the comparisons the figure shows, once each
    for ax, ((method, budget), rows) in zip(axes[0], cells):
        for against, (marker, colour, label) in MARKERS.items():
            hit = rows[rows["against"] == against]
            if hit.empty:
                continue
            ys = [y[(c, s)] + OFFSETS[against] for c, s in zip(hit["conventions"], hit["selection"])]
            err = [hit["delta"] - hit["ci_low"], hit["ci_high"] - hit["delta"]]
            ax.errorbar(hit["delta"], ys, xerr=err, fmt=marker, color=colour, capsize=2, ms=4, lw=1,
                        label=None if against in labelled else label)
            labelled.add(against)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([reading_name(*n) for n in names] if ax is axes[0][0] else [], fontsize=7)
        ax.set_ylim(-0.6, len(names) - 0.4)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{method}, budget {budget}", fontsize=8)
        ax.set_xlabel("difference in score (points)", fontsize=7)
    fig.suptitle(wrapped([title, *setting_knobs(block["run_dir"].iloc[0])], int(12 * fig.get_figwidth())),
                 fontsize=9)
    # one line of legend needs about two panels' width
    fig.legend(loc="outside lower center", ncol=len(MARKERS) if len(cells) > 1 else 1, fontsize=7, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
