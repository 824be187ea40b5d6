"""Budget allocation: how many non-window entries each KV head of a layer keeps.

All functions return a LongTensor (H_kv,) of prefix budgets; the observation window is kept on top.
``budget`` counts entries per KV head *including* the window, as in SnapKV's and AdaKV's code.
"""
from __future__ import annotations

import torch


def uniform_budgets(n_kv_heads: int, budget: int, window: int, n_prefix: int) -> torch.Tensor:
    """SnapKV: every head keeps ``budget - window`` prefix entries."""
    return torch.full((n_kv_heads,), min(budget - window, n_prefix), dtype=torch.long)


def pyramid_layer_budget(layer_idx: int, n_layers: int, budget: int, window: int, n_prefix: int,
                         beta: int = 20) -> int:
    """PyramidKV's prefix budget of one layer (KVCache-Factory's formula).

    With B = budget - window: min = B // beta, max = 2B - min, and layer l keeps ``max - l * steps``
    where ``steps = (max - min) // (L - 1)`` (integer steps, so the mean sits slightly above B).
    When the prompt cannot fill the first layer's share, max is clipped to the prompt and min raised
    so that the two still sum to 2B.
    """
    b = budget - window
    low = b // beta
    high = 2 * b - low
    if high > n_prefix:
        high = n_prefix
        low = 2 * b - high
    steps = (high - low) // max(n_layers - 1, 1)
    return max(0, min(n_prefix, high - layer_idx * steps))


def adaptive_budgets(scores: torch.Tensor, budget: int, window: int, floor: float = 0.2) -> torch.Tensor:
    """AdaKV: heads share the layer's ``H * (budget - window)`` entries by a top-k over all heads' scores.

    ``scores`` is (H_kv, n_prefix). Head h wins ``count_h`` of the layer-wide top-k; with the floor
    ``a`` it keeps ``(1 - a) * count_h + a * B`` (AdaKV's safeguard), rounded by largest remainder so
    the layer total stays exactly ``H * B``. Every head keeps at least ``floor(a * B)``.
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
