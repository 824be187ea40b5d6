"""PyramidKV (Cai et al.): per-layer budgets decrease linearly from the first layer to the last."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .window import WindowEviction


def pyramid_layer_budget(layer_idx: int, n_layers: int, budget: int, window: int, n_prefix: int,
                         beta: int = 20) -> int:
    """PyramidKV's prefix budget of one layer (KVCache-Factory's formula).

    With B = budget - window: min = B // beta, max = 2B - min, and layer l keeps ``max - l * steps``
    where ``steps = (max - min) // (L - 1)`` (integer steps, so the mean sits slightly above B).
    When the prompt cannot fill the first layer's share, max is clipped to the prompt and min raised
    so that the two still sum to 2B.
    """
    b = budget - window
    low = b // beta
    high = 2 * b - low
    if high > n_prefix:
        high = n_prefix
        low = 2 * b - high
    steps = (high - low) // max(n_layers - 1, 1)
    return max(0, min(n_prefix, high - layer_idx * steps))


@dataclass
class PyramidKV(WindowEviction):
    beta: int = 20      # the last layer keeps (budget - window) // beta prefix entries

    def prefix_budgets(self, layer, stage1_scores):
        b = pyramid_layer_budget(layer.layer_idx, layer.n_layers, self.budget, self.window,
                                 stage1_scores.shape[1], self.beta)
        return torch.full((stage1_scores.shape[0],), b, dtype=torch.long)
