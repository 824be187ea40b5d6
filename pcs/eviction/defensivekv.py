"""DefensiveKV and Layer-DefensiveKV (Feng et al., "Taming the Fragility of KV Cache Eviction in LLM Inference",
ICLR 2026), as the authors' code computes them (FFY0/DefensiveKV at 9251b95,
``kvpress/presses/efficient_defensivekv_press.py``; tests/test_defensivekv.py holds pcs to a transcription of it).

The observation window's attention is pooled per query, each query's row rescaled to its mass before pooling, and
aggregated defensively: the largest over the group's query heads and the window's queries, floored at the head's
mean (lines 197-213). Scores are then weighted by each entry's ``||v W^O||_1`` normalised across the KV heads, and a
first stage keeps, per head, the entries of highest mean attention until their share reaches ``mass`` minus the
attention the window paid the ``window`` entries just before it (lines 85-110: that is what the code reads as the
window's own share). The layer's heads share ``H_kv x budget`` entries by one top-k (``EfficientAdaScorerPress``);
Layer-DefensiveKV (``scope: model``) shares the whole model's by one top-k over every layer
(``EfficientAdaGlobalScorerPress``). Its scores are its own: no ``selection`` applies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ConfigError, check_room, positive_int
from .base import LayerState, Method
from .scores import SharedScores, window_attention


@dataclass
class DefensiveKV(Method):
    budget: int
    window: int = 32
    kernel: int = 5
    mass: float = 0.9       # stage 1's attention share, less the window's bias (the code's 0.9)
    scope: str = "layer"    # layer: the heads of a layer share it (DefensiveKV); model: every layer (Layer-DefensiveKV)

    two_stage = True

    def __post_init__(self):
        if not positive_int(self.window):
            raise ConfigError(f"method.window={self.window!r}: DefensiveKV reads the window's queries; it must be at "
                              f"least 1")
        check_room(self.budget, self.window)

    @property
    def model_wide(self) -> bool:
        return self.scope == "model"

    def scored(self, layer: LayerState) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(H_kv, n) scores, the window and stage 1 at the layer's maximum, and (H_kv, m) stage 1's picks over the
        m = n - window prefix entries; None if the layer stays whole."""
        n, w = layer.n_tokens, self.window
        if n <= self.budget:
            return None
        m = n - w
        n_kv = layer.keys.shape[0]
        attention = window_attention(layer.window_queries, layer.keys)                  # (H_q, w, n)
        # The code drops the window's columns, then reads the mass on the last w columns left (line 154).
        attention = attention[:, :, :m]
        window_bias = attention[:, :, -w:].sum(dim=-1).mean().item()
        group = attention.shape[0] // n_kv
        grouped = attention.view(n_kv, group, w, m)
        mean = grouped.mean(dim=1).mean(dim=-2)                                         # (H_kv, m), unpooled
        rows = grouped.sum(dim=-1, keepdim=True)
        pooled = F.avg_pool1d(grouped.reshape(n_kv * group, w, m), kernel_size=self.kernel,
                              padding=self.kernel // 2, stride=1).view(n_kv, group, w, m)
        pooled = pooled / pooled.sum(dim=-1, keepdim=True) * rows
        defensive = pooled.max(dim=1).values.max(dim=-2).values                          # (H_kv, m)
        scores = defensive.clamp(min=defensive.mean(dim=-1, keepdim=True))
        norms = value_output_l1(layer, m)
        scores = scores * (norms / norms.sum(dim=0, keepdim=True))
        picks = self.first_stage(mean, window_bias, n)
        scores = torch.where(picks, scores.max().item(), scores)
        return F.pad(scores, (0, w), value=scores.max().item()), picks

    def first_stage(self, mean: torch.Tensor, window_bias: float, n: int) -> torch.Tensor:
        """(H_kv, m) each head's entries of highest mean attention, before the one whose running share first
        reaches ``mass - window_bias``, at most ``int(m * budget / n - window)`` of them (lines 95-109). Where that
        cap is negative the code's slice keeps all but its last |cap| (``order[:cap]``), and so does this."""
        m = mean.shape[1]
        shares, order = torch.sort(mean / mean.sum(dim=-1, keepdim=True), dim=-1, descending=True)
        count = torch.argmax((torch.cumsum(shares, dim=-1) >= self.mass - window_bias).to(torch.int32), dim=-1)
        count = count.clamp(max=int(m * (self.budget / n) - self.window)).tolist()
        picks = torch.zeros_like(mean, dtype=torch.bool)
        for head, k in enumerate(count):
            picks[head, order[head, :k]] = True
        return picks

    def keep(self, layer: LayerState, stage2=None):
        """The layer's heads share ``H_kv x budget`` entries."""
        scored = self.scored(layer)
        if scored is None:
            return None
        return split_by_head(scored[0], scored[0].shape[0] * self.budget)

    def score(self, layer: LayerState) -> torch.Tensor | None:
        scored = self.scored(layer)
        return None if scored is None else scored[0]

    def choose(self, scores: dict[int, torch.Tensor], n_tokens: int) -> dict[int, list[torch.Tensor]]:
        """Layer-DefensiveKV: one top-k of ``layers x H_kv x budget`` over every layer's scores gives each layer its
        share; each layer then keeps the top of its own scores by that share (lines 172-190 of
        ``efficient_ada_global_scorer_press.py``, then ``layer_compress``)."""
        layers = sorted(scores)
        flat = torch.stack([scores[l].flatten() for l in layers]).flatten()
        winners = flat.topk(len(layers) * scores[layers[0]].shape[0] * self.budget).indices
        shares = torch.zeros(len(layers), dtype=torch.long, device=flat.device).scatter_add_(
            0, winners // scores[layers[0]].numel(), torch.ones_like(winners)).tolist()
        return {l: split_by_head(scores[l], share) for l, share in zip(layers, shares)}

    def stage1(self, layer: LayerState):
        scored = self.scored(layer)
        return None if scored is None else [row.nonzero().flatten() for row in scored[1]]


def value_output_l1(layer: LayerState, m: int) -> torch.Tensor:
    """(H_kv, m) ``||v W^O_h||_1`` of the prefix, the mean over each KV head's query heads (lines 32-55): the norms
    stage 2 computes (``scores.SharedScores``, shared with the other cells of a prefill), each summed in order as
    ``torch.linalg.vector_norm(ord=1)`` sums the authors' one product per query head, to the bit."""
    n_kv, _, d = layer.values.shape
    group = layer.o_proj_weight.shape[1] // d // n_kv
    shared = layer.shared if layer.shared is not None else SharedScores(layer.values, layer.o_proj_weight)
    return shared.value_norms(group, "torch_norm")[:, :m].view(n_kv, group, m).mean(dim=1)


def split_by_head(scores: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The top ``k`` of the (H_kv, n) scores taken together, as ascending positions per head."""
    n_kv, n = scores.shape
    top = scores.flatten().topk(k).indices
    return [(top[top // n == h] - h * n).sort().values for h in range(n_kv)]
