"""Scores that rank cache entries: window attention (SnapKV) and the projected value norm (PCS paper, Alg. 1).

Shapes follow one layer of one sequence: keys/values are (H_kv, n, d), window queries (H_q, w, d).
Query head h reads KV head h // group, as in grouped-query attention.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def window_attention(window_queries: torch.Tensor, keys: torch.Tensor,
                     key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of the last ``w`` queries over all ``n`` keys, causal inside the window.

    Returns (H_q, w, n) in float32. This is line 3 of the paper's Algorithm 2 before the mean.
    ``key_valid`` (H_kv, n) marks real entries when heads are padded to a common length.
    """
    n_q_heads, w, d = window_queries.shape
    n_kv_heads, n, _ = keys.shape
    group = n_q_heads // n_kv_heads
    q = window_queries.float().reshape(n_kv_heads, group * w, d)
    logits = torch.bmm(q, keys.float().transpose(1, 2)).view(n_q_heads, w, n) / math.sqrt(d)
    # Window query j sits at position n - w + j and may not see keys after it.
    future = torch.ones(w, w, dtype=torch.bool, device=keys.device).triu(1)
    logits[:, :, n - w:].masked_fill_(future, float("-inf"))
    if key_valid is not None:
        logits.masked_fill_(~key_valid.repeat_interleave(group, dim=0)[:, None, :], float("-inf"))
    return logits.softmax(dim=-1)


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str, count_padding: bool = False) -> torch.Tensor:
    """1-D pooling along tokens with 'same' padding (SnapKV's clustering step, Alg. 2 line 4). Average
    pooling divides edge tokens by their real neighbours, or with ``count_padding`` by the kernel
    (``F.avg_pool1d``'s default, which kvpress, official AdaKV and KVCache-Factory use)."""
    if kernel <= 1:
        return scores
    x = scores.unsqueeze(1) if scores.dim() == 2 else scores
    if pooling == "max":
        out = F.max_pool1d(x, kernel_size=kernel, stride=1, padding=kernel // 2)
    elif pooling == "avg":
        out = F.avg_pool1d(x, kernel_size=kernel, stride=1, padding=kernel // 2, count_include_pad=count_padding)
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    return out.squeeze(1) if scores.dim() == 2 else out


def group_mean(per_query_head: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Average (H_q, n) scores over each KV head's group of query heads -> (H_kv, n)."""
    n_q_heads, n = per_query_head.shape
    return per_query_head.view(n_kv_heads, n_q_heads // n_kv_heads, n).mean(dim=1)


def rows_per_chunk(budget_bytes: int, row_elements: int, dtype: torch.dtype) -> int:
    """Rows of a (rows, row_elements) product in ``dtype``, plus its float32 copy when ``dtype`` is
    narrower, that fit in ``budget_bytes`` (at least one)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_row = row_elements * (itemsize + (0 if dtype == torch.float32 else 4))
    return max(1, budget_bytes // per_row)


def head_weights(o_proj_weight: torch.Tensor, d: int) -> torch.Tensor:
    """(H_q, d, hidden): query head h's slice ``W^O_h`` of the output projection (hidden, H_q * d), so that
    ``v @ head_weights(...)[h]`` is ``v W^O_h``, the head's contribution to the layer's output."""
    hidden, qd = o_proj_weight.shape
    return o_proj_weight.view(hidden, qd // d, d).permute(1, 2, 0)


def norm_tile(values: torch.Tensor, group: int, hidden: int) -> int:
    """Rows per product of ``projected_value_norms`` for one layer's (H_kv, m, d) prefix values: the
    (group, rows, hidden) product and its float32 copy take at most half of the values' bytes, so the
    temporaries stay within one layer's keys and values."""
    return rows_per_chunk(values.nbytes // 2, group * hidden, values.dtype)


def projected_value_norms(rows: torch.Tensor, weights: torch.Tensor, tile: int) -> torch.Tensor:
    """``||v_i W^O_h||_1`` for the (r, d) value rows ``v_i`` of one KV head and the (group, d, hidden)
    slices ``W^O_h`` of its query heads -> (group, r) float32.

    The rows go through the product ``tile`` at a time, the last tile padded with zeros: every row's norm
    comes from the same (tile, d) x (d, hidden) product whichever other rows are scored with it, so an
    entry's score does not depend on the set it is scored in (exhaustive or bounded stage 2), bit for bit.
    """
    r, d = rows.shape
    n_tiles = -(-r // tile)
    padded = rows.new_zeros(n_tiles * tile, d)
    padded[:r] = rows
    norms = torch.empty(weights.shape[0], n_tiles * tile, dtype=torch.float32, device=rows.device)
    for start in range(0, n_tiles * tile, tile):
        # One unnamed (group, tile, hidden) product at a time: a named one would live on beside the next.
        norms[:, start:start + tile] = (padded[start:start + tile] @ weights).float().abs_().sum(dim=-1)
    return norms[:, :r]
