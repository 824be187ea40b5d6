"""SnapKV (Li et al.): every KV head keeps ``budget - window`` prefix entries plus the window."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .window import WindowEviction


def uniform_budgets(n_kv_heads: int, budget: int, window: int, n_prefix: int) -> torch.Tensor:
    """Every head keeps ``budget - window`` prefix entries (or the whole prefix if it is shorter)."""
    return torch.full((n_kv_heads,), min(budget - window, n_prefix), dtype=torch.long)


@dataclass
class SnapKV(WindowEviction):
    def prefix_budgets(self, layer, stage1_scores):
        return uniform_budgets(stage1_scores.shape[0], self.budget, self.window, stage1_scores.shape[1])
