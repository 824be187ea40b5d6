"""Which prefix entries each KV head keeps, given its budget (the paper's Algorithm 1).

``attention``: top-k of the pooled window attention (SnapKV, PyramidKV and AdaKV as published).
``perturbation``: stage 1 keeps the top ``floor(alpha * B_h)`` by pooled attention; stage 2 fills the
other ``B_h - stage1`` by the perturbation score, which bounds how far the head's output can move.

The paper's algorithm stands plainly in ``pcs.eviction.algorithm1``; this module is the same algorithm for every row
of a layer at once, each profile's conventions (tie rule, stage-1 sizing) applied. Stage 2 scored for every entry
costs d x hidden multiply-adds per entry and query head; ``pcs.eviction.stage2_search`` finds the same top entries
scoring only those that bounds cannot rule out. ``tests/test_algorithm1.py`` holds both to the definition.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .conventions import PAPER, Conventions
from ..upload import upload
from .scores import SharedScores, positions
from .stage2_search import Stage2, Stage2Run


@dataclass
class WindowScores:
    """Scores of one layer's prefix tokens (the n - w tokens before the observation window)."""
    mean_attention: torch.Tensor    # (H_q, m) window-mean attention, Alg. 2 line 3; a scorer's (H_kv, m) scores
    pooled_attention: torch.Tensor  # (H_q, m) after pooling, Alg. 2 line 4; a scorer's (H_kv, m) scores
    stage1: torch.Tensor            # (H_kv, m) group mean of the pooled attention
    prefix_values: torch.Tensor     # (H_kv, m, d)
    o_proj_weight: torch.Tensor     # (hidden, H_q * d)
    valid: torch.Tensor | None = None   # (H_kv, m) real entries, when heads are padded
    window: int = 0                     # the observation window, kept on top of the prefix budgets
    protected: int = 0                  # prefix entries the allocation guarantees each head (kept in stage 1)
    conventions: Conventions = PAPER    # stage-1 size and tie rule (pcs/conf/profile/)
    shared: SharedScores | None = None  # the layer's scores computed once for the runs sharing its prefill


def scored_layer(scores: torch.Tensor, layer, conventions: Conventions, window: int = 0, protected: int = 0,
                 shared: SharedScores | None = None) -> WindowScores:
    """A layer's (H_kv, m) prefix scores from a scorer (not the window's attention), each standing for all of its KV
    head's query heads: a two-stage selection ranks stage 1 by them and stage 2 by them times the entries'
    ``||v W^O_h||_1``, as kvpress's CriticalKVPress does over any press. ``layer``: the ``LayerState`` they score."""
    m = scores.shape[1]
    return WindowScores(scores, scores, scores, layer.values[:, :m], layer.o_proj_weight, window=window,
                        protected=protected, conventions=conventions, shared=shared)


@dataclass
class AttentionSelection:
    two_stage = False

    def select(self, budgets: list[int], ws: WindowScores, tail: int = 0,
               stage2: Stage2Run | None = None) -> list[torch.Tensor]:
        """Per row, the ascending positions of its top ``budgets[r]`` prefix entries, then of the ``tail`` entries
        after the prefix that every row keeps (``positions``). Under ``ties=topk`` and ``window_cut=in_row`` with a
        budget shared by every row, one torch.topk of ``budget + tail`` over the row with the tail at the largest
        float, as kvpress's ``ScorerPress.compress`` takes it over its press's scores (the window padded at the
        maximum plus one): the same entries as a top-k of the prefix alone, but for ties at the cut. ``stage2`` is
        for a selection with a second stage, which this one has not."""
        budgets = [min(b, ws.stage1.shape[1]) for b in budgets]
        c = ws.conventions
        if c.ties == "topk" and c.window_cut == "in_row" and tail and len(set(budgets)) == 1:
            nothing_first = torch.zeros_like(ws.stage1, dtype=torch.bool)
            return positions(one_cut(nothing_first, ws.stage1, budgets[0], tail), budgets, tail)
        ks = upload(budgets, ws.stage1.device)
        return positions(ws.conventions.top_mask(ws.stage1, ks, budgets), budgets, tail)


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

    def stage1_size(self, prefix_budget: int, window: int, rule: str) -> int:
        """Prefix entries stage 1 keeps: ``floor(alpha * B_h)`` of the head's prefix budget (``prefix``), or
        ``int(alpha * b_h)`` of its whole budget with the window counted first (``budget``: the paper's
        ``b' = b x alpha``, and the released code)."""
        if rule == "budget":
            return max(0, int(self.alpha * (prefix_budget + window)) - window)
        return int(self.alpha * prefix_budget)

    def stage1_sizes(self, budgets: list[int], ws: WindowScores) -> list[int]:
        m = ws.stage1.shape[1]
        return [min(m, max(self.stage1_size(b, ws.window, ws.conventions.stage1), min(ws.protected, b)))
                for b in budgets]

    def stage1(self, budgets: list[int], ws: WindowScores) -> list[torch.Tensor]:
        """Stage 1 of Algorithm 1: per KV head, the top ``stage1_size`` prefix entries by pooled attention."""
        sizes = self.stage1_sizes(budgets, ws)
        return positions(ws.conventions.top_mask(ws.stage1, upload(sizes, ws.stage1.device), sizes), sizes)

    def select(self, budgets: list[int], ws: WindowScores, exhaustive: bool = False, tail: int = 0,
               stage2: Stage2Run | None = None) -> list[torch.Tensor]:
        """Algorithm 1 for every KV head of a layer, each with a prefix budget ``budgets[r]``: stage 1 keeps its top
        ``stage1_size`` entries by pooled attention, stage 2 fills the rest of the budget by ``stage2_scores``
        among the entries stage 1 left; then the ``tail`` entries after the prefix that every row keeps (the
        observation window), as ``AttentionSelection.select``. ``exhaustive`` scores every entry in stage 2;
        otherwise ``pcs.eviction.stage2_search`` scores only the entries that could make the cut, keeping the same
        entries, as ``stage2`` says (its search, the engine's ``engine.stage2``, and the prompt's tally it counts in;
        None: the defaults, counted for this layer alone)."""
        budgets = [min(b, ws.stage1.shape[1]) for b in budgets]
        run = stage2 or Stage2Run()
        first, second = self.stages(budgets, ws, run.search.value_norm_kernel)
        # Norms shared by the runs of a prefill are computed for every entry anyway: no bound can save work.
        if exhaustive or second.shared_norms is not None:
            scores = second.exhaustive()
        else:
            scores = second.search(run.search, run.work)
        if ws.conventions.ties == "topk" and len(set(budgets)) == 1:
            return positions(one_cut(first, scores, budgets[0], tail), budgets, tail)
        return positions(first | ws.conventions.top_mask(scores, second.k, second.counts), budgets, tail)

    def stage2_scores(self, ws: WindowScores, excluded: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """Stage 2's score of every prefix entry (Algorithm 1's second stage; Algorithm 2 line 9): for query head h,
        the window's attention on the entry (``stage2_attention``: un-pooled as the paper states it, or pooled,
        plus ``epsilon``) times ``||v W^O_h||_1``, the L1 norm of the entry's value through h's slice of the
        output projection (``norms``, (rows, group, m)), a bound on how far the entry moves h's output; a KV head
        combines its query heads by ``gqa`` (``combine``). Entries stage 1 kept or that are padding
        (``excluded``) score minus infinity."""
        rows, m = excluded.shape
        attention = self.stage2_attention(ws).view(rows, -1, m)
        return self.combine(attention, norms).masked_fill(excluded, float("-inf"))

    def stages(self, budgets: list[int], ws: WindowScores, norm_kernel: bool = True) -> tuple[torch.Tensor, Stage2]:
        """Stage 1's picks for prefix ``budgets`` (each at most the prefix), a (rows, m) mask, and stage 2 over the
        entries they leave, ``budgets[r]`` less row r's picks to choose."""
        sizes = self.stage1_sizes(budgets, ws)
        first = ws.conventions.top_mask(ws.stage1, upload(sizes, ws.stage1.device), sizes)
        excluded = first if ws.valid is None else first | ~ws.valid
        return first, Stage2(self, ws, excluded, [b - size for b, size in zip(budgets, sizes)], norm_kernel)

    def stage2_attention(self, ws: WindowScores) -> torch.Tensor:
        return (ws.mean_attention if self.stage2_source == "unpooled" else ws.pooled_attention) + self.epsilon

    def combine(self, attention: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """(..., group, n) attention and norms of KV heads' query heads -> (..., n) stage-2 scores; attention
        (..., 1, n) stands for every query head of its row (a scorer's scores: ``product_of_means`` is then kvpress's
        ``(score + epsilon) x`` the group's mean norm, to the bit). Monotone in ``norms`` where attention is
        non-negative, so bounds on the norms give bounds on the scores."""
        if self.gqa == "mean_of_products":
            return (attention * norms).mean(dim=-2)
        return attention.mean(dim=-2) * norms.mean(dim=-2)


def one_cut(first: torch.Tensor, scores: torch.Tensor, budget: int, tail: int) -> torch.Tensor:
    """(rows, m) the prefix entries kept as kvpress's CriticalKVPress keeps them: stage 1's picks and the ``tail``
    (the window, scored first in stage 1) at the largest float, then one torch.topk of ``budget + tail`` over the
    whole row (kvpress 0.5.5 presses/criticalkv_press.py lines 93-97, then ScorerPress.compress line 96). The same
    entries as stage 2's own top-k after stage 1, but for ties at the cut, which fall here as they fall there."""
    largest = torch.finfo(scores.dtype).max
    row = scores.masked_fill(first, largest)
    if tail:
        row = torch.cat([row, row.new_full((row.shape[0], tail), largest)], dim=1)
    order = row.topk(budget + tail, dim=-1).indices
    return torch.zeros_like(row, dtype=torch.bool).scatter_(1, order, True)[:, :scores.shape[1]]
