"""Where the needle went: the full cache's retrieval heads (attention on the needle's value while it answers) beside
what each run kept of the needle per (layer, KV head), the retrieval heads' KV heads outlined."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

import numpy as np  # noqa: E402


def panel_names(labels: list[str]) -> list[str]:
    """Each run folder's name without the words every run of the figure shares (the benchmark's setting, the
    budget): ``snapkv_perturbation_stage2_source=pooled`` beside ``snapkv_perturbation``, not two equal titles."""
    words = [label.split("_") for label in labels]
    shared = set.intersection(*map(set, words)) if len(labels) > 1 else set()
    return ["_".join([ws[0]] + [w for w in ws[1:] if w not in shared]) for ws in words]   # the method stays


def needle_heads_figure(retrieval: np.ndarray, kept: dict[str, np.ndarray], heads: list[tuple[int, int]],
                        path: Path, title: str) -> Path | None:
    """``retrieval`` (layers, query heads): the full cache's mean attention on the needle; ``kept``: per run label,
    (layers, KV heads) the mean share of the needle kept; ``heads``: the retrieval heads (layer, query head)."""
    if retrieval.size == 0:
        return None
    n_q = retrieval.shape[1]
    fig, axes = plt.subplots(1, 1 + len(kept), figsize=(2.2 + 2.0 * (1 + len(kept)), 0.16 * retrieval.shape[0] + 2.4),
                             squeeze=False)
    ax = axes[0][0]
    image = ax.imshow(retrieval, aspect="auto", cmap="magma", vmin=0, interpolation="nearest")
    for layer, head in heads:
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="cyan", lw=1.2))
    ax.set_title("full cache: attention\non the needle (mean)", fontsize=8)
    ax.set_xlabel("query head", fontsize=7)
    ax.set_ylabel("layer", fontsize=7)
    # its colour bar below it, outside the panel: taking the panel's room would shrink it, and its layers would
    # no longer line up with the other panels' rows
    fig.colorbar(image, cax=ax.inset_axes([0.0, -0.2, 1.0, 0.03]), orientation="horizontal")
    for ax, name, grid in zip(axes[0][1:], panel_names(list(kept)), kept.values()):
        image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        group = n_q // grid.shape[1] if grid.shape[1] else 1
        for layer, head in heads:
            ax.add_patch(Rectangle((head // group - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.2))
        ax.set_title("\n".join(textwrap.wrap(name.replace("_", " "), 26)) + "\nneedle kept (share)", fontsize=8)
        ax.set_xlabel("KV head", fontsize=7)
        ax.set_xticks(range(grid.shape[1]))      # a model may have one KV head a layer (Gemma 3 270M)
        ax.set_yticks([])                        # the layers are the first panel's
    axes[0][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=list(axes[0][1:]), fraction=0.04)
    fig.suptitle(title, fontsize=9, y=1.06)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path
