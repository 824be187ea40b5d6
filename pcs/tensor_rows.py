"""Row gathers: picking whole vectors (keys, values) out of per-head tensors by position, for the selections and the
cache. On a CPU, ``torch.gather`` with an index expanded over the vectors' dimension reads one index per element;
picking rows of a (rows, d) view of the same memory reads one per row and copies each row whole (several times
faster for rows of 64, float32 and bfloat16). On an accelerator both are one pass over the rows, and the
gather is one launch where the view's indices take three more. The same values either way: both only copy."""
from __future__ import annotations

import torch


def rows_at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(H, c, d) rows of (H, n, d) ``x`` at positions ``idx`` (H, c): ``x[h, idx[h, j]]``. On a CPU ``x`` may be a view
    (a prefill's values are a transpose of the projection's output, stage 2's a slice of them): where each of its
    vectors is contiguous and starts a whole number of vectors apart from the others, the rows are picked in place
    from a (rows, d) view of its memory, without a copy of ``x``."""
    heads, n, d = x.shape
    head_stride, row_stride, column_stride = x.stride()
    if x.device.type != "cpu" or idx.numel() == 0 or column_stride != 1 or head_stride % d or row_stride % d:
        return x.gather(1, idx[..., None].expand(-1, -1, d))
    head_rows, row_rows = head_stride // d, row_stride // d
    memory = x.as_strided(((heads - 1) * head_rows + (n - 1) * row_rows + 1, d), (d, 1))
    where = torch.arange(heads, device=idx.device)[:, None] * head_rows + idx * row_rows
    return memory.index_select(0, where.reshape(-1)).view(heads, idx.shape[1], d)
