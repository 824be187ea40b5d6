"""PyramidKV (Cai et al.): per-layer budgets decrease linearly from the first layer to the last."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .conventions import kvpress_ratio
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


def kvpress_layer_budget(layer_idx: int, n_layers: int, budget: int, window: int, n_tokens: int, beta: int = 20) -> int:
    """kvpress 0.5.5's per-layer budget (``PyramidKVPress.get_layer_budget``), as prefix entries: float steps,
    the window counted inside each layer's total, and SnapKV's uniform budget whenever the smallest layer
    would hold fewer than the window. Computed in floats from the same compression ratio kvpress gets."""
    ratio = kvpress_ratio(budget, n_tokens)
    max_capacity_prompt = window + n_tokens * (1 - ratio)
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= n_tokens - window:
        max_num = n_tokens - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (n_tokens >= max_num >= min_num >= window):
        return max(1, round(n_tokens * (1 - ratio))) - window
    steps = (max_num - min_num) / (n_layers - 1) if n_layers > 1 else 0.0
    return round(max_num - layer_idx * steps) - window


@dataclass
class PyramidKV(WindowEviction):
    beta: int = 20      # the last layer keeps (budget - window) // beta prefix entries

    def prefix_budgets(self, layer, stage1_scores):
        n_prefix, rule = stage1_scores.shape[1], self.conventions.pyramid_budgets
        depth, n_depths = layer.depth    # the pyramid spans the layers methods choose in (a hybrid's full ones)
        if rule == "kvpress":
            b = kvpress_layer_budget(depth, n_depths, self.budget, self.window, layer.n_tokens, self.beta)
        elif rule == "kvcache_factory" and layer.n_tokens < 2 * (self.budget - self.window):
            b = self.budget - self.window   # KVCache-Factory's branch for short prompts: uniform
        else:
            b = pyramid_layer_budget(depth, n_depths, self.budget, self.window, n_prefix, self.beta)
        return torch.full((stage1_scores.shape[0],), min(b, n_prefix), dtype=torch.long)
