"""StreamingLLM (Xiao et al.): the first ``sinks`` tokens (attention sinks) plus the most recent ones."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import check_room
from .base import LayerState, Method, window_positions


@dataclass
class StreamingLLM(Method):
    budget: int
    sinks: int = 4

    def __post_init__(self):
        check_room(self.budget, sinks=self.sinks)

    def keep(self, layer: LayerState, stage2=None):
        n = layer.n_tokens
        if n <= self.budget:
            return None
        device = layer.keys.device
        idx = torch.cat([torch.arange(self.sinks, device=device),
                         window_positions(n, self.budget - self.sinks, device)])
        return [idx for _ in range(layer.keys.shape[0])]
