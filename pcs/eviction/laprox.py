"""LaProx: output-aware scores comparable across heads and layers, one model-wide top-k.

Reconstructed from "Reformulating KV Cache Eviction Problem for Long-Context LLM Inference" (arXiv
2605.07234; no public code). Over the observation window, layer l's attention output is one matrix
product, ``O_l = sum_h A_h V_g(h) W^O_h``, whose inner index is the (head, token) pair. Approximate
matrix multiplication keeps the inner indices with the largest ``||column of the left factor|| x
||row of the right factor||``, so token i of query head h scores

    s(h, i) = ||A_h[:, i]||_2 * ||v_g(h),i W^O_h||_2,

the first norm over the window queries. ``||v W^O_h||_2^2 = v^T (W^O_h^T W^O_h) v``: a d x d Gram
matrix per head gives the value term without a tokens x hidden product. Scores are averaged over
each KV head's query heads, average-pooled along tokens and divided by the layer's sum, so one
top-k over every layer's (KV head, token) pairs spends the whole model's budget; the last
``window`` tokens are kept in every head on top.

Open choices, each a knob (pcs/conf/method/laprox.yaml): ``gqa`` (``mean_of_scores``: score per query
head, then the group mean; ``attention_first``: the column norm of the group's mean attention times
the group's mean value norm), ``pool_on`` (``score`` or ``attention``: pool only the attention
term), ``scope`` (``model``: one top-k over all layers; ``layer``: one per layer, H_kv x (budget -
window) entries each; ``head``: budget - window per KV head), ``sinks`` (first tokens kept in every
head, counted in the budget).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError, check_room, positive_int
from .base import LayerState, Method, window_positions
from .scores import group_mean, output_projection, pool_scores, quadratic_forms, window_attention
from .conventions import PAPER



def value_output_norms(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """``||v_i W^O_h||_2`` for every query head h and token i -> (H_q, n) float32, through the Gram
    matrices of ``output_projection``: d^2 multiply-adds per token and head instead of d x hidden."""
    n_kv_heads, n, d = values.shape
    grams = output_projection(o_proj_weight, d).grams_side_by_side(n_kv_heads)  # (H_kv, d, group * d)
    return quadratic_forms(values, grams, values.nbytes // 2).flatten(0, 1).clamp_min(0).sqrt()


@dataclass
class LaProx(Method):
    budget: int
    window: int = 32
    kernel: int = 7
    gqa: str = "mean_of_scores"
    pool_on: str = "score"
    scope: str = "model"
    sinks: int = 0

    def __post_init__(self):
        if not positive_int(self.window):
            raise ConfigError(f"method.window={self.window!r}: LaProx scores by the window's attention; it must be at "
                              f"least 1")
        check_room(self.budget, self.window, self.sinks)

    @property
    def model_wide(self) -> bool:
        """One top-k over every layer's scores (scope ``model``) needs them all before choosing."""
        return self.scope == "model"

    @property
    def per_head(self) -> int:
        """Entries each KV head keeps on average outside the window."""
        return self.budget - self.window

    def score(self, layer: LayerState) -> torch.Tensor | None:
        """(H_kv, m) scores of the layer's m = n - window prefix entries, summing to 1 over the layer's
        scoreable entries (sinks excluded, they are +inf), or None if the layer stays whole.
        Padding entries (decode-time recompression of ragged heads) are -inf."""
        n, w = layer.n_tokens, self.window
        if n <= self.budget:
            return None
        m = n - w
        n_kv_heads = layer.keys.shape[0]
        valid = layer.valid_entries()
        attn = window_attention(layer.window_queries, layer.keys, valid)[:, :, :m]     # (H_q, w, m)
        values = value_output_norms(layer.values[:, :m], layer.o_proj_weight)          # (H_q, m)
        if self.gqa == "mean_of_scores":
            column = torch.linalg.vector_norm(attn, dim=1)                               # (H_q, m)
            if self.pool_on == "attention":
                column = pool_scores(column, self.kernel, "avg")
            scores = group_mean(column * values, n_kv_heads)
        else:
            group = attn.shape[0] // n_kv_heads
            column = torch.linalg.vector_norm(attn.view(n_kv_heads, group, *attn.shape[1:]).mean(1), dim=1)
            if self.pool_on == "attention":
                column = pool_scores(column, self.kernel, "avg")
            scores = column * group_mean(values, n_kv_heads)
        if self.pool_on == "score":
            scores = pool_scores(scores, self.kernel, "avg")
        # Sinks: each head's first real entries (after its padding, if any), chosen before all others.
        first = layer.pad if layer.pad is not None else torch.zeros(n_kv_heads, dtype=torch.long)
        position = torch.arange(m, device=scores.device)[None, :]
        first = first.to(scores.device)[:, None]
        sink = (position >= first) & (position < first + self.sinks)
        unscored = sink if valid is None else sink | ~valid[:, :m]
        scores = scores.masked_fill(unscored, 0.0)
        scores = scores / scores.sum().clamp_min(torch.finfo(scores.dtype).tiny)
        scores = scores.masked_fill(sink, float("inf"))
        return scores if valid is None else scores.masked_fill(~valid[:, :m], float("-inf"))

    def choose(self, scores: dict[int, torch.Tensor], n_tokens: int) -> dict[int, list[torch.Tensor]]:
        """Kept positions per layer and KV head from every layer's ``score``: one top-k over all
        of them (scope ``model``), per layer, or per head; the window is added to every head."""
        chosen: dict[int, list[torch.Tensor]] = {}
        if self.scope == "model" and scores:
            layers = sorted(scores)
            flat = torch.cat([scores[l].flatten() for l in layers])
            picked = top_positions(flat, len(layers) * scores[layers[0]].shape[0] * self.per_head)
            offsets = [0]
            for l in layers:
                offsets.append(offsets[-1] + scores[l].numel())
            for i, l in enumerate(layers):
                local = picked[(picked >= offsets[i]) & (picked < offsets[i + 1])] - offsets[i]
                chosen[l] = split_by_head(local, scores[l].shape)
        else:
            for l, s in scores.items():
                chosen[l] = self.choose_in_layer(s)
        return {l: [torch.cat([p, window_positions(n_tokens, self.window, p.device)]) for p in kept]
                for l, kept in chosen.items()}

    def choose_in_layer(self, scores: torch.Tensor) -> list[torch.Tensor]:
        if self.scope == "head":
            return [top_positions(s, self.per_head) for s in scores]
        return split_by_head(top_positions(scores.flatten(), scores.shape[0] * self.per_head), scores.shape)

    def keep(self, layer: LayerState, stage2=None):
        """One layer on its own (scopes ``layer`` and ``head``; decode-time recompression under any
        scope, which then selects within the layer: the other layers are not at hand)."""
        scores = self.score(layer)
        if scores is None:
            return None
        window = window_positions(layer.n_tokens, self.window, scores.device)
        return [torch.cat([p, window]) for p in self.choose_in_layer(scores)]


def top_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The top ``k`` (earlier position on ties) that never chooses a -inf entry (padding)."""
    return PAPER.top(scores, min(k, int((scores > float("-inf")).sum())))


def split_by_head(flat_positions: torch.Tensor, shape: tuple[int, int]) -> list[torch.Tensor]:
    """Ascending indices into a flattened (H_kv, m) tensor -> one ascending position tensor per head."""
    n_heads, m = shape
    heads = flat_positions // m
    return [flat_positions[heads == h] - h * m for h in range(n_heads)]
