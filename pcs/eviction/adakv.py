"""AdaKV (Feng et al.): the heads of a layer share ``H x (budget - window)`` prefix entries by one
top-k over all heads' scores, so budgets vary per head."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError
from .window import WindowEviction


def adaptive_budgets(scores: torch.Tensor, budget: int, window: int, floor: float = 0.2) -> torch.Tensor:
    """AdaKV's allocation of one layer, from its (H_kv, n_prefix) stage-1 scores.

    Head h wins ``count_h`` of the layer-wide top-k; with the floor ``a`` it keeps
    ``(1 - a) * count_h + a * B`` (AdaKV's safeguard), rounded by largest remainder so the layer total
    stays exactly ``H * B``. Every head keeps at least ``floor(a * B)``.
    """
    n_kv_heads, n_prefix = scores.shape
    b = min(budget - window, n_prefix)
    total = n_kv_heads * b
    winners = scores.flatten().topk(total).indices // n_prefix
    counts = torch.bincount(winners, minlength=n_kv_heads).double()
    shares = (1.0 - floor) * counts + floor * b
    return largest_remainder(shares, total)


def largest_remainder(shares: torch.Tensor, total: int) -> torch.Tensor:
    """Round non-negative ``shares`` to integers that sum to ``total`` (Hamilton's method)."""
    base = shares.floor().long()
    missing = int(total - base.sum())
    if missing > 0:
        order = (shares - base).argsort(descending=True, stable=True)
        base[order[:missing]] += 1
    return base


@dataclass
class AdaKV(WindowEviction):
    floor: float = 0.2      # each head keeps at least floor x (budget - window) prefix entries

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.floor <= 1.0:
            raise ConfigError(f"method.floor={self.floor} must lie in [0, 1]")

    def prefix_budgets(self, layer, stage1_scores):
        return adaptive_budgets(stage1_scores, self.budget, self.window, self.floor)
