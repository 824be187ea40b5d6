"""Which prefix entries each KV head keeps, given its budget (the paper's Algorithm 1).

``attention``: top-k of the pooled window attention (SnapKV, PyramidKV and AdaKV as published).
``perturbation``: stage 1 keeps the top ``floor(alpha * B_h)`` by pooled attention; stage 2 fills the
other ``B_h - stage1`` by the perturbation score, which bounds how far the head's output can move.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .scores import group_mean, projected_value_norms


@dataclass
class WindowScores:
    """Scores of one layer's prefix tokens (the n - w tokens before the observation window)."""
    mean_attention: torch.Tensor    # (H_q, m) window-mean attention, Alg. 2 line 3
    pooled_attention: torch.Tensor  # (H_q, m) after pooling, Alg. 2 line 4
    stage1: torch.Tensor            # (H_kv, m) group mean of the pooled attention
    prefix_values: torch.Tensor     # (H_kv, m, d)
    o_proj_weight: torch.Tensor     # (hidden, H_q * d)
    valid: torch.Tensor | None = None   # (H_kv, m) real entries, when heads are padded


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` highest scores, ascending. Ties (common after max pooling) go to the
    earlier position, so the choice is deterministic across devices and runs."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k].sort().values


@dataclass
class AttentionSelection:
    name = "attention"

    def select(self, budgets: torch.Tensor, ws: WindowScores) -> list[torch.Tensor]:
        return [topk_sorted(ws.stage1[h], int(budgets[h])) for h in range(len(budgets))]


@dataclass
class PerturbationSelection:
    """Two-stage selection. ``stage2_source``: 'unpooled' (paper, Alg. 2 line 9) or 'pooled' (released code).

    ``gqa``: how a KV head combines its query heads in stage 2. 'mean_of_products' averages
    ``A_h * N_h`` over the group (paper, per head); 'product_of_means' multiplies the group means of
    ``A`` and ``N`` (released code).
    """
    alpha: float = 0.25
    stage2_source: str = "unpooled"
    epsilon: float = 0.0
    gqa: str = "mean_of_products"
    name = "perturbation"

    def stage2_scores(self, ws: WindowScores) -> torch.Tensor:
        attention = ws.mean_attention if self.stage2_source == "unpooled" else ws.pooled_attention
        attention = attention + self.epsilon
        norms = projected_value_norms(ws.prefix_values, ws.o_proj_weight)   # (H_q, m)
        n_kv_heads = ws.stage1.shape[0]
        if self.gqa == "mean_of_products":
            scores = group_mean(attention * norms, n_kv_heads)
        else:
            scores = group_mean(attention, n_kv_heads) * group_mean(norms, n_kv_heads)
        return scores if ws.valid is None else scores.masked_fill(~ws.valid, float("-inf"))

    def stage1_size(self, head_budget: int) -> int:
        return int(self.alpha * head_budget)

    def stage1(self, budgets: torch.Tensor, ws: WindowScores) -> list[torch.Tensor]:
        """Stage 1 of Algorithm 1: per KV head, the top ``floor(alpha * B_h)`` by pooled attention."""
        return [topk_sorted(ws.stage1[h], self.stage1_size(int(budgets[h]))) for h in range(len(budgets))]

    def select(self, budgets: torch.Tensor, ws: WindowScores) -> list[torch.Tensor]:
        stage2 = self.stage2_scores(ws)
        kept = []
        for h, first in enumerate(self.stage1(budgets, ws)):
            b = int(budgets[h])
            rest = stage2[h].clone()
            rest[first] = float("-inf")
            second = topk_sorted(rest, b - len(first))
            kept.append(torch.cat([first, second]).sort().values)
        return kept
