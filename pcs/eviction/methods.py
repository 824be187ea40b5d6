"""Eviction methods: each answers one question per layer, which cache entries does every KV head keep?

A method returns, for one layer, a list with one sorted LongTensor of kept positions per KV head, or
``None`` to keep the whole layer. The selection rule (attention or perturbation) is orthogonal to the
budget allocation (uniform, pyramid, adaptive), so SnapKV, PyramidKV and AdaKV are one class with
different allocators.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .budgets import adaptive_budgets, pyramid_layer_budget, uniform_budgets
from .scores import group_mean, pool_scores, window_attention
from .selection import AttentionSelection, PerturbationSelection, WindowScores


@dataclass
class LayerState:
    """What a method may look at for one layer right after prefill."""
    layer_idx: int
    n_layers: int
    keys: torch.Tensor            # (H_kv, n, d), rotary already applied
    values: torch.Tensor          # (H_kv, n, d)
    window_queries: torch.Tensor  # (H_q, w, d), the last w queries, rotary applied
    o_proj_weight: torch.Tensor   # (hidden, H_q * d)
    pad: torch.Tensor | None = None   # (H_kv,) leading padding entries per head (decode-time recompression)

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[1]

    def valid_entries(self) -> torch.Tensor | None:
        """(H_kv, n) True for real entries when heads are padded at the front, else None."""
        if self.pad is None:
            return None
        return torch.arange(self.n_tokens, device=self.keys.device)[None, :] >= self.pad[:, None]


class FullCache:
    """Keeps everything: the reference every method is measured against."""
    uses_selection = False

    def keep(self, layer: LayerState):
        return None


@dataclass
class StreamingLLM:
    """Attention sinks plus the most recent tokens (Xiao et al.): ``sinks`` first and ``budget - sinks`` last."""
    budget: int
    sinks: int = 4
    uses_selection = False

    def keep(self, layer: LayerState):
        n = layer.n_tokens
        if n <= self.budget:
            return None
        idx = torch.cat([torch.arange(self.sinks), torch.arange(n - (self.budget - self.sinks), n)])
        idx = idx.to(layer.keys.device)
        return [idx for _ in range(layer.keys.shape[0])]


# An allocator maps (layer, stage-1 scores (H_kv, m)) to prefix budgets per KV head.
Allocator = Callable[[LayerState, torch.Tensor], torch.Tensor]


@dataclass
class WindowEviction:
    """SnapKV-style eviction: score the prefix by the observation window, allocate, select (Alg. 2).

    The last ``window`` tokens are always kept and count in ``budget``; a layer whose prompt fits in
    its budget is left whole.
    """
    budget: int
    window: int
    kernel: int
    pooling: str
    allocator: Allocator
    selection: AttentionSelection | PerturbationSelection
    uses_selection = True

    def plan(self, layer: LayerState) -> tuple[WindowScores, torch.Tensor] | None:
        """The layer's prefix scores and per-KV-head prefix budgets, or None if it stays whole."""
        n, w = layer.n_tokens, self.window
        if n <= self.budget:
            return None
        m = n - w
        valid = layer.valid_entries()
        attn = window_attention(layer.window_queries, layer.keys, valid)  # (H_q, w, n)
        mean = attn[:, :, :m].mean(dim=1)                                # (H_q, m)
        pooled = pool_scores(mean, self.kernel, self.pooling)
        ws = WindowScores(mean, pooled, group_mean(pooled, layer.keys.shape[0]),
                          layer.values[:, :m], layer.o_proj_weight)
        if valid is not None:
            ws.valid = valid[:, :m]
            ws.stage1 = ws.stage1.masked_fill(~ws.valid, float("-inf"))
        budgets = self.allocator(layer, ws.stage1)
        if valid is not None:
            budgets = torch.minimum(budgets, ws.valid.sum(dim=1).to(budgets.device))
        return None if int(budgets.min()) >= m else (ws, budgets)

    def keep(self, layer: LayerState):
        planned = self.plan(layer)
        if planned is None:
            return None
        ws, budgets = planned
        return [torch.cat([prefix, self.window_positions(layer)]) for prefix in self.selection.select(budgets, ws)]

    def window_positions(self, layer: LayerState) -> torch.Tensor:
        return torch.arange(layer.n_tokens - self.window, layer.n_tokens, device=layer.keys.device)


def uniform_allocator(budget: int, window: int) -> Allocator:
    return lambda layer, s1: uniform_budgets(s1.shape[0], budget, window, s1.shape[1])


def pyramid_allocator(budget: int, window: int, beta: int) -> Allocator:
    def allocate(layer: LayerState, s1: torch.Tensor) -> torch.Tensor:
        b = pyramid_layer_budget(layer.layer_idx, layer.n_layers, budget, window, s1.shape[1], beta)
        return torch.full((s1.shape[0],), b, dtype=torch.long)
    return allocate


def adaptive_allocator(budget: int, window: int, floor: float) -> Allocator:
    return lambda layer, s1: adaptive_budgets(s1, budget, window, floor)
