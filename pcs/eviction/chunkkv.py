"""ChunkKV (Liu et al., 2025; kvpress's ChunkKVPress): a window method's scores (any ``scorer``) summed over the
layer's KV heads and averaged per chunk of ``chunk`` consecutive entries; the best chunks are kept whole, the same in
every head, so that what is kept stays readable text. As kvpress 0.5.5's ``ChunkKVPress.compress`` chooses
(presses/chunkkv_press.py lines 52-117): the entries after the last whole chunk form one more chunk; the window
scores the maximum plus one, as SnapKVPress pads it; ``max(1, int(chunks x (1 - compression ratio)))`` chunks are
kept, so a layer keeps about its budget, a chunk more or less; a prompt shorter than one chunk is cut as the scorer's
own method cuts it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import budget as budgets
from ..config import ConfigError, positive_int
from .base import Method
from .conventions import kvpress_ratio
from .selection import AttentionSelection
from .snapkv import SnapKV


@dataclass
class ChunkKV(SnapKV):
    selection: AttentionSelection = field(default_factory=AttentionSelection)   # chunks are kept whole: no selection
    chunk: int = 20         # entries per chunk (ChunkKVPress's chunk_length)

    def __post_init__(self):
        super().__post_init__()
        if not positive_int(self.chunk):
            raise ConfigError(f"method.chunk={self.chunk!r}: ChunkKV keeps chunks of at least 1 entry")

    def for_prompt(self, n_tokens: int) -> Method:
        return self      # a share of the prompt counts chunks (``chunks_kept``), as kvpress's ratio does

    def chunks_kept(self, n_chunks: int, n_tokens: int) -> int:
        ratio = 1 - self.budget if budgets.is_share(self.budget) else kvpress_ratio(self.budget, n_tokens)
        return max(1, int(n_chunks * (1 - ratio)))

    def keep(self, layer, stage2=None):
        n, w = layer.n_tokens, self.window
        if budgets.entries(self.budget, n, w + self.sinks) >= n:
            return None
        if n < self.chunk:       # no whole chunk: the scorer's own cut
            return SnapKV.keep(SnapKV.for_prompt(self, n), layer, stage2)
        m = n - w
        ws = self.scored(layer, m, layer.shared) if self.scorer != "window_attention" else \
            self.attended(layer, m, None, layer.shared)
        row = torch.cat([ws.stage1, (ws.stage1.max() + 1).expand(ws.stage1.shape[0], w)], dim=1)   # (H_kv, n)
        whole, rest = divmod(n, self.chunk)
        chunk_scores = row[:, :whole * self.chunk].sum(dim=0).view(whole, self.chunk).mean(dim=-1)
        if rest:
            chunk_scores = torch.cat([chunk_scores, row[:, -rest:].sum(dim=0).mean(dim=-1, keepdim=True)])
        kept = self.conventions.top(chunk_scores, self.chunks_kept(len(chunk_scores), n))
        starts = kept * self.chunk
        entries = (starts[:, None] + torch.arange(self.chunk, device=starts.device)).flatten()
        entries = entries[entries < n]                       # the last chunk holds the ``rest`` entries
        return [entries] * layer.keys.shape[0]
