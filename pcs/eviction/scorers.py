"""Scores that rank a layer's prefix without the observation window's pooled attention: the scorers of NVIDIA
kvpress 0.5.5, each as its press's ``score`` computes it, for a window method's ``scorer`` knob
(``method=knorm``, or ``method=adakv method.scorer=knorm method.window=0`` for AdaKV's allocation over it).

A scorer rates every one of a layer's n entries per KV head, higher kept first; the method keeps its ``window``
newest entries on top (kvpress pads them with the maximum score plus one) and ranks the prefix before them. What a
scorer reads and how it may combine is data here (``SCORERS``), torch-free, so a config is checked before torch
loads.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scorer:
    """A scorer's needs. ``window``: the newest entries its press always keeps and the queries it reads (None: any
    window the method sets). ``signed``: its scores may be negative. A two-stage selection over a scorer ranks its
    second stage by the scorer's score times ``||v W^O||``, as kvpress's CriticalKVPress does over any press (over
    a negative score a larger norm ranks lower, as there); such a stage is searched exhaustively, since the
    bounded search assumes scores of at least zero."""
    window: int | None
    signed: bool


SCORERS = {
    "window_attention": Scorer(window=None, signed=False),   # SnapKV's: the window's pooled attention
    "knorm": Scorer(window=None, signed=True),
    "keydiff": Scorer(window=None, signed=True),
    "tova": Scorer(window=1, signed=False),
}


def knorm(layer):
    """Minus each key's L2 norm, in float32: low-norm keys draw attention (kvpress 0.5.5
    ``presses/knorm_press.py`` lines 45-46)."""
    import torch
    return -torch.linalg.vector_norm(layer.keys, dim=-1, dtype=torch.promote_types(layer.keys.dtype, torch.float32))


def keydiff(layer):
    """Minus each key's cosine similarity to the head's mean unit key (not renormalised): keys least like the
    rest are kept (kvpress 0.5.5 ``presses/keydiff_press.py`` lines 36-46)."""
    import torch.nn.functional as F
    anchor = F.normalize(layer.keys, p=2, dim=-1).mean(dim=1, keepdim=True)
    return -F.cosine_similarity(layer.keys, anchor, dim=-1)


def tova(layer):
    """The newest query's attention over the entries before it, averaged over every query head of the model and
    the same for every KV head; the newest entry itself scores the maximum plus one (kvpress 0.5.5
    ``presses/tova_press.py`` lines 35-61, the path without attention weights: ``1/sqrt(d)``, no soft-capping)."""
    import torch.nn.functional as F
    from .scores import window_attention
    attention = window_attention(layer.window_queries[:, -1:], layer.keys, layer.valid_entries())[:, 0, :-1]
    scores = attention.mean(dim=0).expand(layer.keys.shape[0], -1)
    return F.pad(scores, (0, 1), value=scores.max().item() + 1)


SCORE = {"knorm": knorm, "keydiff": keydiff, "tova": tova}
