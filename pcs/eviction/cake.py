"""CAKE (Qin et al., "Cascading and Adaptive KV Cache Eviction with Layer Preferences", ICLR 2025), as the
DefensiveKV authors' code computes it (FFY0/DefensiveKV at 9251b95, ``kvpress/presses/cake_global_press.py`` and
``cake_scorer_press.py``; tests/test_cake.py holds pcs to a transcription of both).

Each layer's window attention ``A`` (the last ``window`` queries over the prefix, causal inside the window, not
renormalised once the window's own columns are dropped) gives two things:

- the entries' scores: ``mean + gamma x var`` of ``A`` over the window's queries (unbiased variance), average-pooled
  along entries (``kernel``, the padding counted), the mean over each KV head's query heads;
- the layer's preference ``H^(1/tau1) x V^(1/tau2)``: ``H`` the entropy of ``A`` summed over every head, query and
  entry, ``V`` its variance over the window's queries summed over heads and entries. A layer whose attention is
  spread out and shifts from query to query asks for more.

The model's prefix budget, ``int((entries per head - window) x layers)``, is split in proportion to the preferences
and adjusted to integers as ``CakeScorerPress.adjust_budgets`` does (``layer_budgets``); every KV head of a layer
then keeps the same number of its own top entries, and the window on top. The authors' code evicts every layer once
the prefill ends (no cascade, so the one-shot allocation CAKE's cascade approximates); so does pcs.

pcs computes the attention, its statistics and the preferences in float32. The code keeps them in the model's dtype
(on a bf16 model the softmax, the mean, the variance, the pooling and ``V^(1/tau2)`` are rounded to bf16), so the
same entries are kept on a float32 model, and near-ties or a layer's budget may fall otherwise on a bf16 one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import budget as budgets
from ..config import ConfigError, check_room, positive_int
from .base import LayerState, Method, window_positions
from .stage2_search import Stage2Run
from .conventions import PAPER, Conventions, kvpress_ratio
from .scores import group_mean, pool_scores, window_attention
from .selection import AttentionSelection, PerturbationSelection, scored_layer


@dataclass(frozen=True)
class LayerPreference:
    """What CAKE reads of one layer: its prefix entries' (H_kv, m) scores and its 0-d float32 preference."""
    scores: torch.Tensor
    preference: torch.Tensor


def layer_budgets(shares: list[float], total: int, cap: int) -> list[int]:
    """Integer prefix budgets from the layers' real-valued ``shares`` of ``total`` (``adjust_budgets``,
    cake_scorer_press.py lines 42-88): each truncated and held to ``cap``, what the held ones lose handed out equally to
    the others (the remainder one each, first layers first, in one pass: a layer may pass the cap); then whatever the
    sum still misses of ``total`` handed out (or taken back from layers above 1) the same way."""
    out = [int(s) for s in shares]
    excess = sum(max(b - cap, 0) for b in out)
    out = [min(b, cap) for b in out]
    if excess > 0:
        out = handed_out(out, [b < cap for b in out], excess)
    missing = total - sum(out)
    if missing > 0:
        out = handed_out(out, [b < cap for b in out], missing)
    elif missing < 0:
        out = handed_out(out, [b > 1 for b in out], missing)
    return out


def handed_out(out: list[int], open_: list[bool], amount: int) -> list[int]:
    """``amount`` (or, negative, minus it) shared equally among the ``open_`` layers, one more (less) each for the
    first ``|amount| mod count`` of them."""
    count = sum(open_)
    if not count:
        return out
    each, rest = divmod(abs(amount), count)
    sign = 1 if amount > 0 else -1
    firsts = [i for i, o in enumerate(open_) if o][:rest]
    return [b + sign * (each * o + (i in firsts)) for i, (b, o) in enumerate(zip(out, open_))]


@dataclass
class CAKE(Method):
    budget: int | float
    conventions: Conventions = PAPER
    window: int = 32
    kernel: int = 5
    gamma: float = 200.0    # the variance's weight in an entry's score
    tau1: float = 1.6       # the entropy's temperature in a layer's preference
    tau2: float = 0.6       # the variance's temperature
    # attention: each head's top entries by CAKE's score | perturbation: the paper's two stages fill each head's count
    selection: AttentionSelection | PerturbationSelection = field(default_factory=AttentionSelection)

    model_wide = True

    @property
    def choice_reads_layers(self) -> bool:
        return self.selection.two_stage

    def __post_init__(self):
        if not (positive_int(self.window) and self.window >= 2):
            raise ConfigError(f"method.window={self.window!r}: CAKE reads the variance of the window's attention over "
                              f"its queries; it needs at least 2")
        for knob in ("tau1", "tau2"):
            if not getattr(self, knob) > 0:
                raise ConfigError(f"method.{knob}={getattr(self, knob)!r}: a layer's preference takes a 1/{knob} power; "
                                  f"it must be above 0")
        check_room(self.budget, self.window)

    def for_prompt(self, n_tokens: int) -> Method:
        return self      # a share of the prompt is counted as kvpress's ratio counts it (``total``)

    def total(self, n_tokens: int, n_layers: int) -> int:
        """The prefix entries every chosen layer's KV head shares, ``int((n x (1 - ratio) - window) x layers)``
        (cake_scorer_press.py line 184), at least 0."""
        ratio = 1 - self.budget if budgets.is_share(self.budget) else kvpress_ratio(self.budget, n_tokens)
        return max(0, int((n_tokens * (1 - ratio) - self.window) * n_layers))

    def score(self, layer: LayerState) -> LayerPreference | None:
        """The layer's entry scores and preference (cake_global_press.py lines 112-123), or None where the budget
        holds the prompt."""
        n, w = layer.n_tokens, self.window
        if budgets.entries(self.budget, n, w) >= n:
            return None
        attention = window_attention(layer.window_queries, layer.keys)[:, :, :n - w]       # (H_q, w, m)
        entropy = -(attention * torch.log(attention + 1e-10)).sum()
        spread = attention.var(dim=1)                                                       # (H_q, m)
        preference = entropy ** (1 / self.tau1) * spread.sum(0).sum(0) ** (1 / self.tau2)
        scores = pool_scores(attention.mean(dim=1) + self.gamma * spread, self.kernel, "avg", count_padding=True)
        return LayerPreference(group_mean(scores, layer.keys.shape[0]), preference)

    def choose(self, scores: dict[int, LayerPreference], n_tokens: int, layers: dict[int, LayerState] | None = None,
               stage2: Stage2Run | None = None) -> dict[int, list[torch.Tensor]]:
        """Every layer's budget from the preferences, then each KV head's top entries and the window
        (cake_scorer_press.py lines 181-196 and 91-134), or, under a two-stage selection, the paper's two stages
        within each head's count (``layers``: what the second stage reads)."""
        states, layers = layers, sorted(scores)
        m, total = n_tokens - self.window, self.total(n_tokens, len(layers))
        preferences = [scores[l].preference for l in layers]
        whole = preferences[0]
        for p in preferences[1:]:      # summed one after another in float32, as Python's sum adds the arrays
            whole = whole + p
        shares = [float(p / whole * total) for p in preferences]
        kept = {}
        for layer, count in zip(layers, layer_budgets(shares, total, m)):
            prefix = scores[layer].scores
            count = min(count, m)
            if self.selection.two_stage:
                ws = scored_layer(prefix, states[layer], self.conventions, window=self.window)
                kept[layer] = self.selection.select([count] * prefix.shape[0], ws, tail=self.window,
                                                    stage2=stage2)
                continue
            mask = self.conventions.top_mask(prefix, prefix.new_full((prefix.shape[0],), count, dtype=torch.long),
                                             [count] * prefix.shape[0])
            window = window_positions(n_tokens, self.window, prefix.device)
            kept[layer] = [torch.cat([row.nonzero().flatten(), window]) for row in mask]
        return kept
