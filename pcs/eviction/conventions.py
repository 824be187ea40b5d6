"""Conventions: the choices on which the paper's text, NVIDIA kvpress, the official AdaKV code and
KVCache-Factory differ, each a knob of the ``profile`` config group (pcs/conf/profile/).

A profile sets them all at once; ``profile.<knob>=...`` varies one alone. Budgets stay absolute entries
per KV head whatever the profile (``kvpress_ratio`` is the one conversion to kvpress's compression ratio).
Torch-free (``top`` only calls the tensor's own methods), so the config's validation builds a profile before
torch loads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

CHOICES = {
    "avg_pool_padding": ("real", "zeros"),
    "stage1": ("prefix", "budget"),
    "adakv_allocation": ("largest_remainder", "kvpress", "official"),
    "pyramid_budgets": ("steps", "kvcache_factory", "kvpress"),
    "ties": ("earlier", "topk"),
    "gqa": ("pool_then_mean", "mean_then_pool", "per_query_head"),
}


@dataclass(frozen=True)
class Conventions:
    avg_pool_padding: str = "real"
    stage1: str = "prefix"
    adakv_allocation: str = "largest_remainder"
    pyramid_budgets: str = "steps"
    ties: str = "earlier"
    # A KV head's scores: its query heads' pooled scores averaged | averaged, then pooled | none: every query
    # head keeps its own budget of its KV head's entries (official AdaKV's gqa_support=False).
    gqa: str = "pool_then_mean"

    def __post_init__(self):
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"profile.{key}={getattr(self, key)!r} is not valid; choose one of: "
                                  f"{', '.join(allowed)}")

    def top(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Ascending positions of the ``k`` highest of 1-D ``scores``, ties broken by the convention:
        ``earlier`` (stable: deterministic on every device) or ``topk`` (``torch.topk``'s own order)."""
        if k <= 0:
            return scores.new_empty(0).long()
        if self.ties == "topk":
            return scores.topk(k).indices.sort().values
        return scores.sort(descending=True, stable=True).indices[:k].sort().values

    def top_mask(self, scores: torch.Tensor, ks: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """(rows, m) True at each row's ``top`` ``counts[r]`` entries of (rows, m) ``scores`` (``ks``: the counts
        on the scores' device). Under ``earlier`` in a few operations for every row at once (a stable order is the
        same whatever k); under ``topk`` in one call where every row keeps as many entries, as kvpress's presses
        call it (on a CPU each row's choice is the one it makes alone), else row by row, as torch.topk's choice
        among ties depends on k."""
        import torch
        rows, m = scores.shape
        if self.ties == "topk" and len(set(counts)) == 1:
            mask = torch.zeros_like(scores, dtype=torch.bool)
            return mask.scatter_(1, scores.topk(counts[0], dim=-1).indices, True) if counts[0] else mask
        if self.ties == "topk":
            flat = [row.topk(k).indices + r * m for r, (row, k) in enumerate(zip(scores, counts)) if k > 0]
            mask = torch.zeros(rows * m, dtype=torch.bool, device=scores.device)
            return (mask.index_fill_(0, torch.cat(flat), True) if flat else mask).view(rows, m)
        order = scores.sort(dim=-1, descending=True, stable=True).indices
        ranked = torch.arange(m, device=scores.device) < ks[:, None]
        return torch.zeros_like(order, dtype=torch.bool).scatter_(1, order, ranked)


PAPER = Conventions()


def kvpress_ratio(budget: int, n_tokens: int) -> float:
    """kvpress's ``compression_ratio`` that keeps ``budget`` of ``n_tokens`` entries per head: kvpress keeps
    ``int(n * (1 - ratio))``, so ``1 - budget / n`` is nudged down to the next float for which that
    product is not rounded to ``budget - 1``."""
    ratio = 1.0 - budget / n_tokens
    while int(n_tokens * (1 - ratio)) < budget:
        ratio = math.nextafter(ratio, -math.inf)
    return ratio
