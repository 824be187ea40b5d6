"""SnapKV-style eviction, shared by SnapKV, PyramidKV and AdaKV: the observation window scores the
prefix, an allocation gives each KV head its budget, the selection picks the entries (Alg. 2). ``scorer``
replaces the window's pooled attention by another score of the prefix (``pcs.eviction.scorers``: kvpress's
KNorm, KeyDiff, TOVA, Expected Attention, observed attention, LagKV, CUR), under the same allocations and
selections.

The selection rule (attention or perturbation) is orthogonal to the allocation (uniform, pyramid,
adaptive): a method here only says how a layer's budget is split, in ``prefix_budgets``. The last
``window`` tokens are always kept and count in ``budget``; a layer whose prompt fits in its budget is
left whole.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import check_room
from .base import LayerState, Method
from .stage2_search import Stage2Run
from .conventions import PAPER, Conventions
from .scorers import SCORERS
from .scores import group_mean, pool_scores, window_attention
from .selection import AttentionSelection, PerturbationSelection, WindowScores, scored_layer


@dataclass
class WindowEviction(Method):
    budget: int
    selection: AttentionSelection | PerturbationSelection
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    conventions: Conventions = PAPER
    scorer: str = "window_attention"
    scorer_epsilon: float = 0.0

    def __post_init__(self):
        check_room(self.budget, self.window)

    @property
    def two_stage(self) -> bool:
        return self.selection.two_stage

    @property
    def exhaustive_stage2(self) -> bool:
        return self.two_stage and SCORERS[self.scorer].signed     # the bounded search needs scores >= 0

    @property
    def sinks(self) -> int:
        return SCORERS[self.scorer].sinks

    def prefix_budgets(self, layer: LayerState, stage1_scores: torch.Tensor) -> torch.Tensor:
        """(H_kv,) prefix entries each KV head keeps, given the (H_kv, m) stage-1 scores of its prefix."""
        raise NotImplementedError

    def protected(self) -> int:
        """Prefix entries the allocation guarantees every head, by the same ranking as stage 1, so that a
        two-stage selection keeps them before its second stage (kvpress's AdaKV safeguard)."""
        return 0

    def plan(self, layer: LayerState) -> tuple[WindowScores, list[int]] | None:
        """The layer's prefix scores and prefix budgets, one row per KV head (per query head where query
        heads choose apart, ``gqa=per_query_head``), or None if the layer stays whole."""
        n, w = layer.n_tokens, self.window
        if n <= self.budget:
            return None
        m = n - w
        valid = layer.valid_entries()
        shared = layer.shared if valid is None else None
        if self.scorer != "window_attention":
            ws = self.scored(layer, m, shared)
            ws.valid = None if valid is None else valid[:, :m]
        else:
            ws = self.attended(layer, m, valid, shared)
        if ws.valid is not None:
            ws.stage1 = ws.stage1.masked_fill(~ws.valid, float("-inf"))
        budgets = self.prefix_budgets(layer, ws.stage1)
        if ws.valid is not None:
            budgets = torch.minimum(budgets, ws.valid.sum(dim=1).to(budgets.device))
        budgets = budgets.tolist()      # the selections index and size by them on the host: one read
        return None if min(budgets) >= m else (ws, budgets)

    def scored(self, layer: LayerState, m: int, shared) -> WindowScores:
        """The prefix ranked by the method's scorer: per KV head, the scores standing for all its query heads where a
        second stage weighs them (as kvpress's CriticalKVPress multiplies its press's scores)."""
        scorer = SCORERS[self.scorer]
        if scorer.epsilon:
            score, name = (lambda layer: scorer.score(layer, self.scorer_epsilon)), f"{self.scorer}+{self.scorer_epsilon}"
        else:
            score, name = scorer.score, self.scorer
        if scorer.positional and layer.pad is not None:
            score = each_head_unpadded(score)
        scores = (score(layer) if shared is None else shared.scorer(name, lambda: score(layer)))
        return scored_layer(scores[:, :m].float(), layer, self.conventions, self.window, self.protected(), shared)

    def attended(self, layer: LayerState, m: int, valid, shared) -> WindowScores:
        """The prefix ranked by the observation window's pooled attention (Alg. 2 lines 3-5), per the profile's
        GQA convention; ``valid`` marks real entries where heads are padded (``ws.valid`` then set, per row)."""
        w = self.window

        def window_mean():
            attn = window_attention(layer.window_queries, layer.keys, valid)  # (H_q, w, n)
            return attn[:, :, :m].mean(dim=1)                                # (H_q, m)
        mean = window_mean() if shared is None else shared.window_mean(w, window_mean)
        zeros = self.conventions.avg_pool_padding == "zeros"
        pooled = pool_scores(mean, self.kernel, self.pooling, zeros)
        n_kv_heads, values = layer.keys.shape[0], layer.values[:, :m]
        if self.conventions.gqa == "mean_then_pool":   # official AdaKV's gqa_support: the group's attention, pooled
            stage1 = pool_scores(group_mean(mean, n_kv_heads), self.kernel, self.pooling, zeros)
        elif self.conventions.gqa == "per_query_head":   # each query head chooses alone: one row per query head
            group = mean.shape[0] // n_kv_heads
            stage1, values = pooled, values.repeat_interleave(group, dim=0)
            valid = None if valid is None else valid.repeat_interleave(group, dim=0)
        else:
            stage1 = group_mean(pooled, n_kv_heads)
        ws = WindowScores(mean, pooled, stage1, values, layer.o_proj_weight, window=w, protected=self.protected(),
                          conventions=self.conventions, shared=shared)
        if valid is not None:
            ws.valid = valid[:, :m]
        return ws

    def keep(self, layer: LayerState, stage2: Stage2Run | None = None):
        planned = self.plan(layer)
        if planned is None:
            return None
        # The window's positions follow the prefix's m = n - window: the selection appends them to every row.
        if self.exhaustive_stage2:
            return self.selection.select(planned[1], planned[0], exhaustive=True, tail=self.window,
                                         stage2=stage2)
        return self.selection.select(planned[1], planned[0], tail=self.window, stage2=stage2)

    def stage1(self, layer: LayerState):
        planned = self.plan(layer)
        if planned is None or not self.two_stage:
            return None
        return self.selection.stage1(planned[1], planned[0])


def each_head_unpadded(score):
    """A positional scorer (``Scorer.positional``) over heads padded at the front: each head scored on its own
    entries alone, as a batch of one scores them, its padding at minus infinity."""
    def scored(layer: LayerState) -> torch.Tensor:
        rows = []
        for h, pad in enumerate(layer.pad.tolist()):
            alone = dataclasses.replace(layer, keys=layer.keys[h:h + 1, pad:], values=layer.values[h:h + 1, pad:],
                                        pad=None, shared=None)
            rows.append(torch.nn.functional.pad(score(alone)[0].float(), (pad, 0), value=float("-inf")))
        return torch.stack(rows)
    return scored
