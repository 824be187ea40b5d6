"""A method added the documented way, for test_adding_a_method.py: this module and a config file.

KeyNorm keeps, in every KV head, the ``budget`` entries whose keys have the smallest L2 norm (the idea
of kvpress's KnormPress)."""
from dataclasses import dataclass

from pcs.eviction.base import LayerState, Method


@dataclass
class KeyNorm(Method):
    budget: int

    def keep(self, layer: LayerState, stage2=None):
        if layer.n_tokens <= self.budget:
            return None
        norms = layer.keys.float().norm(dim=-1)                   # (H_kv, n)
        return [h.topk(self.budget, largest=False).indices.sort().values for h in norms]
