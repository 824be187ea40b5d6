"""Needle-in-a-Haystack figures (paper Figure 8): a run's depth x length heatmap, and a grid of methods
(rows) without and with perturbation selection (columns) at one budget."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..identity import RunIdentity  # noqa: E402
from ..run_folder import saved_config  # noqa: E402


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
    identity = RunIdentity(saved_config(run_dir))
    return save_heatmap(json.loads((Path(run_dir) / "metrics.json").read_text()), identity.title, path)


def save_heatmap(metrics: dict, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.8))
    fig.colorbar(draw_heatmap(ax, metrics, title), ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def needle_comparison(run_dirs: list[Path], path: Path, budget: int, setting: list[str] = ()) -> Path | None:
    """Rows: methods; columns: without and with perturbation selection, at one budget (a method
    without selection, such as LaProx, fills the first column of its row), of runs of one ``setting`` (its knobs in
    words, in the title)."""
    cells = {}
    for run_dir in run_dirs:
        identity = RunIdentity(saved_config(run_dir))
        if identity.reads_budget and identity.cfg.budget == budget:
            cells[(identity.cfg.method.name, identity.selection_label)] = run_dir
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
    fig.suptitle(", ".join([f"Needle-in-a-Haystack at budget {budget}", *setting]))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
