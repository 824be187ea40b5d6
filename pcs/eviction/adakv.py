"""AdaKV (Feng et al.): the heads of a layer share ``H x (budget - window)`` prefix entries by one
top-k over all heads' scores, so budgets vary per head."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..upload import upload
from .scores import positions
from .stage2_search import Stage2, Stage2Run
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
    counts = heads_won(winners, n_kv_heads).double()
    shares = (1.0 - floor) * counts + floor * b
    return largest_remainder(shares, total)


def kvpress_budgets(scores: torch.Tensor, budget: int, window: int, safeguard: float) -> torch.Tensor:
    """kvpress 0.5.5's allocation (``AdaKVPress.compress``), as prefix entries per head: the window scores
    ``max + 1`` (SnapKVPress), each head's top ``max(1, int(budget * safeguard))`` entries (window first) are
    protected, then one top-k over the layer's ``H x budget`` entries."""
    n_kv_heads, n_prefix = scores.shape
    # the window's score stays on the device (no ``item()``): the float32 sum is the Python one rounded to float32
    padded = torch.cat([scores, (scores.max() + 1).expand(n_kv_heads, window)], dim=1)
    n_safe = max(1, int(budget * safeguard)) if safeguard > 0 else 0
    protected = padded.topk(n_safe, dim=-1).indices
    padded = padded.scatter(-1, protected, torch.finfo(padded.dtype).max)
    winners = padded.flatten().topk(n_kv_heads * budget).indices // padded.shape[1]
    return heads_won(winners, n_kv_heads) - window


def kvpress_kept(scores: torch.Tensor, budget: int, window: int, safeguard: float) -> torch.Tensor:
    """(H_kv, n_prefix) the prefix entries kvpress 0.5.5's ``AdaKVPress.compress`` keeps (lines 62-79): after the
    protection of ``kvpress_budgets``, the complement of one bottom-k of the layer's ``H x (n - budget)`` entries,
    so that ties at the cut fall as its torch.topk lets them (``kvpress_budgets``' top-k picks the same entries
    but for such ties)."""
    n_kv_heads, n_prefix = scores.shape
    padded = torch.cat([scores, (scores.max() + 1).expand(n_kv_heads, window)], dim=1)
    n_safe = max(1, int(budget * safeguard)) if safeguard > 0 else 0
    padded = padded.scatter(-1, padded.topk(n_safe, dim=-1).indices, torch.finfo(padded.dtype).max)
    pruned = (-padded).flatten().topk(n_kv_heads * (padded.shape[1] - budget)).indices
    kept = torch.ones(padded.numel(), dtype=torch.bool, device=scores.device)
    kept[pruned] = False
    return kept.view(n_kv_heads, -1)[:, :n_prefix]


def kvpress_critical_kept(scores: torch.Tensor, norms: torch.Tensor, budget: int, window: int, head_budgets: list[int],
                          safeguard: float, first_stage_ratio: float, epsilon: float) -> torch.Tensor:
    """(H_kv, n) the entries kvpress 0.5.5's ``CriticalAdaKVPress.compress`` keeps (criticalkv_press.py lines 150-200),
    from its press's (H_kv, n - window) prefix scores (the window scoring max + 1, as SnapKVPress and TOVAPress pad
    it), ``norms`` (H_kv, n) the group mean of ``||v W^O_h||_1`` of every entry (``vwl1norm``), and the heads' budgets,
    window included (lines 166-171: ``kvpress_budgets``' top-k, plus the window). Each top-k is kvpress's own, over
    the same tensor with the same k: the safeguard (lines 155-159), stage 1 (174-178), stage 2 (181-186), then one
    bottom-k over the layer (193-194), so that ties at every cut fall as they fall there."""
    largest = torch.finfo(scores.dtype).max
    n_kv_heads = scores.shape[0]
    row = torch.cat([scores, (scores.max() + 1).expand(n_kv_heads, window)], dim=1)
    n_safe = max(1, int(budget * safeguard)) if safeguard > 0 else 0
    row = row.scatter(-1, row.topk(n_safe, dim=-1).indices, largest)
    first = (torch.tensor(head_budgets) * first_stage_ratio).to(torch.int64).tolist()   # line 174, on the host
    row = marked(row, first, largest)
    row = marked((row + epsilon) * norms, head_budgets, largest)
    pruned = (-row).flatten().topk(n_kv_heads * (row.shape[1] - budget)).indices
    return torch.ones(row.numel(), dtype=torch.bool, device=row.device).scatter_(0, pruned, False).view(n_kv_heads, -1)


def marked(row: torch.Tensor, counts: list[int], value: float) -> torch.Tensor:
    """``row`` with each head's first ``counts[h]`` entries of one sorted torch.topk of the largest count set to
    ``value`` (criticalkv_press.py lines 175-178 and 183-186)."""
    if not max(counts):
        return row
    order = row.topk(max(counts), dim=-1, sorted=True).indices
    first = torch.arange(order.shape[1], device=row.device) < upload(counts, row.device)[:, None]
    return row.masked_fill(torch.zeros_like(row, dtype=torch.bool).scatter_(1, order, first), value)


def official_budgets(scores: torch.Tensor, budget: int, window: int, floor: float) -> torch.Tensor:
    """The official AdaKV allocation (FFY0/AdaKV ``AdaptiveSnapKVCluster.update_kv_gqa``): with
    ``B = budget - window``, head h wins ``count_h`` of the layer-wide top ``H x B`` and keeps
    ``round((1 - a) * count_h + int(a * B))`` prefix entries (so the layer total is what it comes to)."""
    n_kv_heads, _ = scores.shape
    b = budget - window
    winners = scores.flatten().topk(n_kv_heads * b).indices // scores.shape[1]
    counts = heads_won(winners, n_kv_heads)
    return torch.round(counts * (1 - floor) + int(b * floor)).long()


def heads_won(winners: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """How many of ``winners`` (head indices) each head has. Not ``torch.bincount``: on CUDA it reads the
    indices' min and max back to the host (its output's size depends on them), two waits per layer."""
    return torch.zeros(n_kv_heads, dtype=torch.long, device=winners.device).scatter_add_(
        0, winners, torch.ones_like(winners))


def largest_remainder(shares: torch.Tensor, total: int) -> torch.Tensor:
    """Round non-negative ``shares`` to integers that sum to ``total`` (Hamilton's method): the ``missing`` largest
    remainders (the earlier head first among equal ones) get one more. ``missing`` stays on the device, compared
    with each head's rank: reading it to slice the order would make a GPU's host wait."""
    base = shares.floor().long()
    missing = total - base.sum()
    order = (shares - base).argsort(descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    return base + (rank < missing)


@dataclass
class AdaKV(WindowEviction):
    floor: float = 0.2      # each head keeps at least floor x (budget - window) prefix entries

    def protected(self) -> int:
        if self.conventions.adakv_allocation == "kvpress" and self.floor > 0:
            return max(0, max(1, int(self.budget * self.floor)) - self.window)
        return 0

    def keep(self, layer, stage2: Stage2Run | None = None):
        """As every window method keeps, but for kvpress's conventions, where the layer's entries are pruned as
        ``AdaKVPress`` prunes them (attention alone: ``kvpress_kept``) or as ``CriticalAdaKVPress`` does (the
        released selection: ``kvpress_critical_kept``): the same entries, ties included."""
        if not self.replays_kvpress(layer):
            return super().keep(layer, stage2)
        planned = self.plan(layer)
        if planned is None:
            return None
        ws, budgets = planned
        if not self.two_stage:
            kept = kvpress_kept(ws.stage1, self.budget, self.window, self.floor)
            return positions(kept, kept.sum(dim=1).tolist(), self.window)
        norms = self.value_norms(layer, ws, stage2 or Stage2Run())
        kept = kvpress_critical_kept(ws.stage1, norms, self.budget, self.window, [b + self.window for b in budgets],
                                     self.floor, self.selection.alpha, self.selection.epsilon)
        return positions(kept, kept.sum(dim=1).tolist())

    def replays_kvpress(self, layer) -> bool:
        """Whether the layer is chosen as kvpress's AdaKVPress or CriticalAdaKVPress chooses it: kvpress's allocation
        and tie rule, a budget per KV head, and for two stages kvpress's (its stage-1 size, the scores plus epsilon
        times the group's mean norm) over a scorer (KnormPress, ...: whose scores tie exactly on repeated tokens), on
        unpadded heads. Over the window's pooled attention stage 2 keeps its bounded search (``engine.stage2``), which
        needs the norms of the entries that may make the cut only: the same entries but for exact ties."""
        c, s = self.conventions, self.selection
        if c.adakv_allocation != "kvpress" or c.ties != "topk" or c.gqa == "per_query_head":
            return False
        return not self.two_stage or (self.scorer != "window_attention" and c.stage1 == "budget"
                                      and layer.pad is None and s.stage2_source == "pooled"
                                      and s.gqa == "product_of_means")

    def value_norms(self, layer, ws, stage2: Stage2Run) -> torch.Tensor:
        """(H_kv, n) the group mean of ``||v W^O_h||_1`` of every entry, the window's too
        (``CriticalKVPress.vwl1norm``), as stage 2 computes them (an entry's norm is the same bits whichever entries
        are asked for), counted as a stage 2 that scores every entry."""
        rows, n = ws.stage1.shape[0], layer.n_tokens
        blank = ws.stage1.new_zeros(rows, n)
        whole = dataclasses.replace(ws, mean_attention=blank, pooled_attention=blank, stage1=blank,
                                    prefix_values=layer.values, window=0, valid=None)
        stage2.work.add_every_entry_layer(rows, n - self.window)
        return Stage2(self.selection, whole, blank.bool(), [0] * rows,
                      stage2.search.value_norm_kernel).norms().mean(dim=-2)

    def prefix_budgets(self, layer, stage1_scores):
        rule = self.conventions.adakv_allocation
        if rule == "kvpress":
            return kvpress_budgets(stage1_scores, self.budget, self.window, self.floor)
        if rule == "official":
            return official_budgets(stage1_scores, self.budget, self.window, self.floor)
        return adaptive_budgets(stage1_scores, self.budget, self.window, self.floor)
