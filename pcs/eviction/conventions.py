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
    "window_cut": ("apart", "in_row"),
    "gqa": ("pool_then_mean", "mean_then_pool", "per_query_head"),
    "l1_norm": ("abs_sum", "torch_norm"),
    "kvzip_count": ("exact", "ratio"),
}


@dataclass(frozen=True)
class Conventions:
    avg_pool_padding: str = "real"
    stage1: str = "prefix"
    adakv_allocation: str = "largest_remainder"
    pyramid_budgets: str = "steps"
    ties: str = "earlier"
    # Under ``ties=topk``, how attention alone cuts a windowed row: ``apart``, one top-k of the prefix, the window
    # kept beside it (KVCache-Factory's and official AdaKV's SnapKV) | ``in_row``, one top-k over the whole row with
    # the window scored above every entry (kvpress's ScorerPress.compress over SnapKVPress's or TOVAPress's max + 1
    # padding). The same entries but for ties at the cut, which torch.topk breaks by the row it is given.
    window_cut: str = "apart"
    # A KV head's scores: its query heads' pooled scores averaged | averaged, then pooled | none: every query
    # head keeps its own budget of its KV head's entries (official AdaKV's gqa_support=False).
    gqa: str = "pool_then_mean"
    # How stage 2 sums ``|v W^O_h|`` over the hidden features on a CPU (the scores' last bits, which decide between
    # entries whose scores come within about 1e-6 of each other): ``abs_sum``, torch's sum of the absolute values
    # (a cascade, a third of the time) | ``torch_norm``, ``torch.norm(p=1)``'s one sequential reduction (kvpress's
    # CriticalKVPress.vwl1norm: its bits). Accelerators always take one reduction (``NormPlan.one_reduction``).
    l1_norm: str = "abs_sum"
    # How many entries KVzip evicts where layers or heads share its budget: ``exact``, all but ``budget`` per head of
    # the layers or heads that share it | ``ratio``, ``int(entries x compression ratio)`` as kvpress's
    # KVzipPress.compress_post counts them (its float product may round one entry down, so one more stays).
    kvzip_count: str = "exact"

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
        """(rows, m) True at each row's top ``counts[r]`` entries of (rows, m) ``scores`` (``ks``: the counts on
        the scores' device), in a few operations for every row at once. Under ``earlier``, by one stable sort (its
        order is the same whatever k: each row keeps what ``top`` keeps). Under ``topk``, as kvpress's presses call
        torch.topk: once for every row with the largest count, sorted, each row keeping its first ``counts[r]``
        (``CriticalAdaKVPress.compress``'s two stages, kvpress 0.5.5 criticalkv_press.py lines 175-178 and
        183-186; with equal counts, the one call of the other presses). Among ties torch.topk's choice depends on
        k, so a row keeping fewer than the largest count may break a tie at its cut otherwise than ``top`` would."""
        import torch
        rows, m = scores.shape
        if self.ties == "topk":
            mask = torch.zeros_like(scores, dtype=torch.bool)
            if not max(counts):
                return mask
            order = scores.topk(max(counts), dim=-1, sorted=True).indices
            if min(counts) == max(counts):
                return mask.scatter_(1, order, True)
            return mask.scatter_(1, order, torch.arange(order.shape[1], device=scores.device) < ks[:, None])
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
