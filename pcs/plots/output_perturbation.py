"""Figures of a perturbation-analysis run (``benchmark=perturbation``), written next to its metrics.json:

- headwise_scatter.png   per head, baseline vs each other selection (paper Figure 2);
- layerwise.png          mean L1 distance of each layer's output hidden state (Figures 3a, 5);
- final_layer_per_sample.png   the final layer's distance per context (Figures 3b, 6);
- final_layer_vs_budget.png    the final layer's mean distance across budgets (Figure 3c);
- assumption1.png        attention mass of the stage-1 entries per head, and its histogram (Figure 4).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def labelled(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Axis labels, title and legend of a one-panel figure, then save it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    save(fig, path)


def headwise_scatter(metrics: dict, path: Path) -> None:
    base = metrics["baseline"]
    others = list(metrics["comparisons"])
    x = np.array(metrics["headwise_mean"][base])
    fig, axes = plt.subplots(1, len(others), figsize=(5 * len(others), 4.6), squeeze=False)
    layers = np.repeat(np.arange(x.shape[0]), x.shape[1])
    for ax, label in zip(axes[0], others):
        y = np.array(metrics["headwise_mean"][label])
        points = ax.scatter(x.ravel(), y.ravel(), c=layers, cmap="viridis", s=12, alpha=0.8)
        positive = np.concatenate([x.ravel(), y.ravel()])
        positive = positive[positive > 0]
        if positive.size:
            lo, hi = positive.min(), positive.max()
            ax.plot([lo, hi], [lo, hi], "k--", lw=1)
            ax.set_xscale("log")
            ax.set_yscale("log")
        c = metrics["comparisons"][label]
        ax.set_title(f"{label}: lower in {c['heads_improved']} of {c['n_heads']} heads")
        ax.set_xlabel(f"head output perturbation, {base}")
        ax.set_ylabel(f"head output perturbation, {label}")
    fig.colorbar(points, ax=axes[0].tolist(), label="layer")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def layerwise(metrics: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, curve in metrics["layerwise"].items():
        ax.plot(range(len(curve)), curve, marker="o", ms=3, label=label)
    labelled(fig, ax, path, "layer", "L1 distance of the layer output", f"Layer-wise perturbation, budget {metrics['budget']}")


def final_layer_per_sample(metrics: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    series = metrics["final_layer_per_sample"]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar(np.arange(len(values)) + i * width, values, width, label=label)
    labelled(fig, ax, path, "context", "L1 distance of the final layer output",
             f"Final-layer perturbation per context, budget {metrics['budget']}")


def final_layer_vs_budget(metrics: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, by_budget in metrics["final_layer_by_budget"].items():
        budgets = sorted(by_budget, key=int)
        ax.plot([int(b) for b in budgets], [by_budget[b] for b in budgets], marker="o", label=label)
    ax.set_xscale("log", base=2)
    labelled(fig, ax, path, "budget (entries per KV head)", "mean L1 distance, final layer",
             "Final-layer perturbation across budgets")


def assumption1(metrics: dict, path: Path) -> None:
    mass = np.array([[np.nan if v is None else v for v in layer] for layer in metrics["assumption1_mass"]])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    image = left.imshow(mass.T, aspect="auto", cmap="RdYlGn", vmin=0, vmax=1, origin="lower")
    left.set_xlabel("layer")
    left.set_ylabel("query head")
    left.set_title("attention mass of stage-1 entries and window")
    fig.colorbar(image, ax=left)
    right.hist(mass[~np.isnan(mass)], bins=20, range=(0, 1), color="tab:blue")
    right.axvline(0.5, color="k", ls="--")
    frac = metrics["assumption1_frac"]
    right.set_title(f"Assumption 1 holds in {100 * frac:.1f} % of heads" if frac is not None else "no layer compressed")
    right.set_xlabel("attention mass")
    right.set_ylabel("heads")
    save(fig, path)


FIGURES = {"headwise_scatter.png": headwise_scatter, "layerwise.png": layerwise,
           "final_layer_per_sample.png": final_layer_per_sample,
           "final_layer_vs_budget.png": final_layer_vs_budget, "assumption1.png": assumption1}


def write_figures(metrics: dict, run_dir: Path) -> list[Path]:
    paths = []
    for name, draw in FIGURES.items():
        draw(metrics, Path(run_dir) / name)
        paths.append(Path(run_dir) / name)
    return paths
