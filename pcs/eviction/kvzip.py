"""KVzip (Kim et al., NeurIPS 2025) and KVzip+ (its scores normalised, kvpress PR #172): every entry ranked by the
attention it draws while the model repeats its context (``pcs.reconstruction``), so the ranking depends on no
question. As kvpress 0.5.5's ``KVzipPress.compress_post`` chooses: the first ``sinks`` entries score the highest
score plus one; the entries of every layer and KV head compete in one ranking (``scope: model``, its default), or
each layer's heads share the layer's (``scope: layer``, its ``layerwise=True``), so heads and layers keep uneven
numbers of entries; a layer then evicts its lowest-scoring entries by its count.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import budget as budgets
from ..config import ConfigError, positive_int
from .base import LayerState, Method, Reconstruction
from .stage2_search import Stage2Run
from .conventions import PAPER, Conventions, kvpress_ratio
from .selection import AttentionSelection, PerturbationSelection, scored_layer


@dataclass
class KVzip(Method):
    budget: int | float
    conventions: Conventions = PAPER
    plus: bool = False      # KVzip+: each attention over its query's input norm, times the entry's ||v W^O||_2
    scope: str = "model"    # model: every layer's heads share the budget | layer: each layer's heads share its own
    chunk: int = 2048       # context tokens repeated per forward
    sinks: int = 4          # first entries always kept
    # attention: KVzip's ranking keeps its entries | perturbation: the ranking gives each head its count, which the
    # paper's two stages fill (stage 1 by the score, stage 2 by the score times ||v W^O_h||_1)
    selection: AttentionSelection | PerturbationSelection = field(default_factory=AttentionSelection)

    model_wide = True

    def __post_init__(self):
        if not positive_int(self.chunk):
            raise ConfigError(f"method.chunk={self.chunk!r}: KVzip repeats the context in chunks of at least 1 token")

    @property
    def choice_reads_layers(self) -> bool:
        return self.selection.two_stage

    @property
    def reconstruction(self) -> Reconstruction:
        return Reconstruction(self.chunk, self.sinks, self.plus)

    def for_prompt(self, n_tokens: int) -> Method:
        return self      # a share of the prompt is counted over the layers' entries (``evicted``)

    def evicted(self, entries: int, n_tokens: int) -> int:
        """How many of ``entries`` (n_tokens per head of the heads and layers that share them) are evicted."""
        if self.conventions.kvzip_count == "ratio":
            ratio = 1 - self.budget if budgets.is_share(self.budget) else kvpress_ratio(self.budget, n_tokens)
            return int(entries * ratio)
        kept = budgets.entries(self.budget, n_tokens, self.sinks)
        return entries - entries // n_tokens * kept

    def lowest(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the ``k`` lowest of 1-D ``scores`` (ties: the later evicted, or torch.topk's choice)."""
        if k <= 0:
            return scores.new_empty(0, dtype=torch.long)
        if self.conventions.ties == "topk":
            return (-scores).topk(k).indices
        return scores.sort(descending=True, stable=True).indices[scores.numel() - k:]

    def choose(self, scores: dict[int, torch.Tensor], n_tokens: int, layers: dict[int, LayerState] | None = None,
               stage2: Stage2Run | None = None) -> dict[int, list[torch.Tensor]]:
        """Per layer of ``scores`` (its (H_kv, n) reconstruction scores), the kept positions of each head; under a
        two-stage selection, each head's count filled by it (``layers``: what its second stage reads)."""
        if budgets.entries(self.budget, n_tokens, self.sinks) >= n_tokens:
            return {}
        states, layers = layers, sorted(scores)
        ranked = torch.stack([scores[l] for l in layers])                          # (L, H_kv, n)
        ranked[..., :self.sinks] = ranked.amax() + 1
        per_layer = ranked[0].numel()
        if self.scope == "layer":
            counts = [self.evicted(per_layer, n_tokens)] * len(layers)
        else:
            out = self.lowest(ranked.flatten(), self.evicted(ranked.numel(), n_tokens))
            counts = torch.zeros(len(layers), dtype=torch.long, device=out.device).scatter_add_(
                0, out // per_layer, torch.ones_like(out)).tolist()
        kept = {}
        for i, (layer, count) in enumerate(zip(layers, counts)):
            keep = torch.ones(per_layer, dtype=torch.bool, device=ranked.device)
            keep[self.lowest(ranked[i].flatten(), count)] = False
            kept[layer] = [row.nonzero().flatten() for row in keep.view(ranked.shape[1], n_tokens)]
            if self.selection.two_stage:     # each head's count filled by the two stages, the sinks in stage 1
                ws = scored_layer(ranked[i], states[layer], self.conventions, protected=self.sinks)
                kept[layer] = self.selection.select([len(row) for row in kept[layer]], ws,
                                                    stage2=stage2)
        return kept
