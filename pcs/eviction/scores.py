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


def projected_value_norms(values: torch.Tensor, o_proj_weight: torch.Tensor,
                          max_bytes: int | None = None) -> torch.Tensor:
    """``||v_i W^O_h||_1`` for every query head h and token i -> (H_q, n) float32.

    ``o_proj_weight`` is the (hidden, H_q * d) weight of the output projection; query head h owns its
    input columns ``[h*d, (h+1)*d)``. Work goes head by head and in token chunks so that the temporary
    (chunk x hidden) product never takes more than ``max_bytes`` (default: the bytes of ``values``, so
    the whole computation stays within one layer's keys and values), never a tokens x heads x hidden tensor.
    """
    n_kv_heads, n, d = values.shape
    hidden, qd = o_proj_weight.shape
    n_q_heads = qd // d
    group = n_q_heads // n_kv_heads
    if max_bytes is None:
        max_bytes = values.nbytes
    chunk = min(n, rows_per_chunk(max_bytes, hidden, values.dtype))
    norms = torch.empty(n_q_heads, n, dtype=torch.float32, device=values.device)
    for h in range(n_q_heads):
        w_h = o_proj_weight[:, h * d:(h + 1) * d]          # (hidden, d): v W^O_h == w_h @ v
        v = values[h // group]
        for start in range(0, n, chunk):
            # One unnamed (chunk, hidden) product at a time: a named one would live on beside the next.
            norms[h, start:start + chunk] = (v[start:start + chunk] @ w_h.T).float().abs_().sum(dim=-1)
    return norms
