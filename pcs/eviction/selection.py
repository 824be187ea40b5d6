"""Which prefix entries each KV head keeps, given its budget (the paper's Algorithm 1).

``attention``: top-k of the pooled window attention (SnapKV, PyramidKV and AdaKV as published).
``perturbation``: stage 1 keeps the top ``floor(alpha * B_h)`` by pooled attention; stage 2 fills the
other ``B_h - stage1`` by the perturbation score, which bounds how far the head's output can move.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError
from .base import check_choice
from .conventions import PAPER, Conventions
from .scores import group_mean, projected_value_norms, rows_per_chunk

STAGE2_SOURCES = ("unpooled", "pooled")
GQA_COMBINATIONS = ("mean_of_products", "product_of_means")


@dataclass
class WindowScores:
    """Scores of one layer's prefix tokens (the n - w tokens before the observation window)."""
    mean_attention: torch.Tensor    # (H_q, m) window-mean attention, Alg. 2 line 3
    pooled_attention: torch.Tensor  # (H_q, m) after pooling, Alg. 2 line 4
    stage1: torch.Tensor            # (H_kv, m) group mean of the pooled attention
    prefix_values: torch.Tensor     # (H_kv, m, d)
    o_proj_weight: torch.Tensor     # (hidden, H_q * d)
    valid: torch.Tensor | None = None   # (H_kv, m) real entries, when heads are padded
    window: int = 0                     # the observation window, kept on top of the prefix budgets
    protected: int = 0                  # prefix entries the allocation guarantees each head (kept in stage 1)
    conventions: Conventions = PAPER    # stage-1 size and tie rule (pcs/conf/profile/)


@dataclass
class AttentionSelection:
    two_stage = False

    def select(self, budgets: torch.Tensor, ws: WindowScores) -> list[torch.Tensor]:
        return [ws.conventions.top(ws.stage1[h], int(budgets[h])) for h in range(len(budgets))]


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
    two_stage = True

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"selection.alpha={self.alpha} must lie in [0, 1]")
        check_choice("selection.stage2_source", self.stage2_source, STAGE2_SOURCES)
        check_choice("selection.gqa", self.gqa, GQA_COMBINATIONS)

    def stage2_scores(self, ws: WindowScores) -> torch.Tensor:
        attention = self.stage2_attention(ws)
        norms = projected_value_norms(ws.prefix_values, ws.o_proj_weight)   # (H_q, m)
        n_kv_heads = ws.stage1.shape[0]
        if self.gqa == "mean_of_products":
            scores = group_mean(attention * norms, n_kv_heads)
        else:
            scores = group_mean(attention, n_kv_heads) * group_mean(norms, n_kv_heads)
        return scores if ws.valid is None else scores.masked_fill(~ws.valid, float("-inf"))

    def stage1_size(self, prefix_budget: int, window: int, rule: str) -> int:
        """Prefix entries stage 1 keeps: ``floor(alpha * B_h)`` of the head's prefix budget (``prefix``), or
        ``int(alpha * b_h)`` of its whole budget with the window counted first (``budget``: the paper's
        ``b' = b x alpha``, and the released code)."""
        if rule == "budget":
            return max(0, int(self.alpha * (prefix_budget + window)) - window)
        return int(self.alpha * prefix_budget)

    def stage1(self, budgets: torch.Tensor, ws: WindowScores) -> list[torch.Tensor]:
        """Stage 1 of Algorithm 1: per KV head, the top ``stage1_size`` prefix entries by pooled attention."""
        sizes = [max(self.stage1_size(int(b), ws.window, ws.conventions.stage1), min(ws.protected, int(b)))
                 for b in budgets]
        return [ws.conventions.top(ws.stage1[h], size) for h, size in enumerate(sizes)]

    def select(self, budgets: torch.Tensor, ws: WindowScores, exhaustive: bool | None = None) -> list[torch.Tensor]:
        """Stage 1, then stage 2's top entries; both ways below keep the same sets. ``exhaustive`` scores
        every entry in a few large products, without waiting on the device: the default on accelerators,
        where those products are cheap. Otherwise (the default on CPU) stage 2 computes exact scores only
        where an upper bound says they could make the cut (``stage2_topk``), which saves most of the
        products but reads the bound back after every chunk: on a GPU that waiting costs far more than it
        saves (8K tokens, H100: 11 s against 0.3 s for the attention selection's whole prefill)."""
        if exhaustive is None:
            exhaustive = ws.prefix_values.device.type != "cpu"
        stage2 = self.stage2_scores(ws) if exhaustive else None
        kept = []
        for h, first in enumerate(self.stage1(budgets, ws)):
            k = int(budgets[h]) - len(first)
            if exhaustive:
                rest = stage2[h].clone()
                rest[first] = float("-inf")
                second = ws.conventions.top(rest, k)
            else:
                second = self.stage2_topk(ws, h, first, k)
            kept.append(torch.cat([first, second]).sort().values)
        return kept

    def stage2_attention(self, ws: WindowScores) -> torch.Tensor:
        return (ws.mean_attention if self.stage2_source == "unpooled" else ws.pooled_attention) + self.epsilon

    def combine(self, attention: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """(group, n) attention and norms of one KV head's query heads -> (n,) stage-2 scores."""
        if self.gqa == "mean_of_products":
            return (attention * norms).mean(dim=0)
        return attention.mean(dim=0) * norms.mean(dim=0)

    def stage2_topk(self, ws: WindowScores, g: int, first: torch.Tensor, k: int) -> torch.Tensor:
        """Exact top-``k`` of KV head ``g``'s stage-2 scores, computing ``||v W^O_h||_1`` only for
        entries whose upper bound ``sum_j |v_j| ||W^O_h[:, j]||_1`` could still beat the k-th best
        exact score found so far, in decreasing order of that bound (branch and bound)."""
        values = ws.prefix_values[g]                                   # (m, d)
        m, d = values.shape
        group = ws.mean_attention.shape[0] // ws.stage1.shape[0]
        attention = self.stage2_attention(ws)[g * group:(g + 1) * group]       # (group, m)
        w = torch.stack([ws.o_proj_weight[:, h * d:(h + 1) * d] for h in range(g * group, (g + 1) * group)])
        column_l1 = w.float().abs().sum(dim=1)                                 # (group, d)
        bound = self.combine(attention, (values.float().abs() @ column_l1.T).T) * (1 + 1e-4)   # (m,)
        excluded = torch.zeros(m, dtype=torch.bool, device=values.device)
        excluded[first] = True
        if ws.valid is not None:
            excluded |= ~ws.valid[g]
        bound = bound.masked_fill(excluded, float("-inf"))
        order = torch.sort(bound, descending=True, stable=True).indices
        exact = torch.full((m,), float("-inf"), device=values.device)
        # The (group, chunk, hidden) product takes at most half of the layer's value bytes, so the
        # scan's temporaries stay within one layer's keys and values (as projected_value_norms's do).
        budget_bytes = ws.prefix_values.nbytes // 2
        rows = rows_per_chunk(budget_bytes, group * ws.o_proj_weight.shape[0], values.dtype)
        chunk, done = min(max(2 * k, 256), rows), 0
        while done < m and k > 0:
            idx = order[done:done + chunk]
            idx = idx[torch.isfinite(bound[idx])]
            if len(idx) == 0:
                break
            norms = (values[idx] @ w.transpose(1, 2)).float().abs_().sum(dim=-1)   # (group, len)
            exact[idx] = self.combine(attention[:, idx], norms)
            done += chunk
            if done < m and int(torch.isfinite(exact).sum()) >= k:
                kth = exact.topk(k).values[-1]
                if bound[order[done]] < kth:
                    break
        return ws.conventions.top(exact, k)
