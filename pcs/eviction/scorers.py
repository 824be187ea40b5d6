"""Scores that rank a layer's prefix without the observation window's pooled attention: the scorers of NVIDIA
kvpress 0.5.5, each as its press's ``score`` computes it, for a window method's ``scorer`` knob
(``method=knorm``, or ``method=adakv method.scorer=knorm method.window=0`` for AdaKV's allocation over it):
KNorm, KeyDiff, TOVA, Expected Attention, observed attention (H2O's), LagKV and CUR.

A scorer rates every one of a layer's n entries per KV head, higher kept first; the method keeps its ``window``
newest entries on top (kvpress pads them with the maximum score plus one) and ranks the prefix before them. What a
scorer reads and how it may combine is data here (``SCORERS``), torch-free, so a config is checked before torch
loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Scorer:
    """A scorer's needs. ``window``: the newest entries its press always keeps and the queries it reads (None: any
    window the method sets). ``signed``: its scores may be negative. ``prompt``: it reads every query of the prompt
    (``LayerState.prompt``), which only a prefill has, so decoding-time compression cannot use it. ``sinks``: the
    first entries its press always keeps (the budget must hold them). A two-stage selection over a scorer ranks its
    second stage by the scorer's score times ``||v W^O||``, as kvpress's CriticalKVPress does over any press (over
    a negative score a larger norm ranks lower, as there); such a stage is searched exhaustively, since the
    bounded search assumes scores of at least zero. ``score``: (layer) -> (H_kv, n) scores (None for the window's
    pooled attention, which the window methods compute themselves). ``epsilon``: it takes the method's
    ``scorer_epsilon`` (``score(layer, epsilon)``), a constant added to each attention before the value norm scales it
    (ExpectedAttentionPress's ``epsilon``; kvpress's leaderboard runs it at 1e-2). ``positional``: it reads entries by
    their place in the sequence (partitions, local windows, sinks), so a head padded at the front (decoding-time
    compression of a pool) is scored on its own entries alone, as a batch of one scores them."""
    window: int | None
    signed: bool
    prompt: bool = False
    sinks: int = 0
    score: Callable | None = None
    epsilon: bool = False
    positional: bool = False


EXPECTED_SINKS, EXPECTED_FUTURE = 4, 512     # ExpectedAttentionPress's n_sink and n_future_positions (lines 56-57)
LAGKV_SINKS, LAGKV_LAG = 4, 128               # LagKVPress's n_sink and lag_size (lagkv_press.py lines 41-42)
CUR_SINKS, CUR_WINDOW = 4, 16                 # CURPress's num_sinks and local_window_size (cur_press.py lines 28, 32)
# Observed attention computes a head's n x n weights at once up to this size, as the eager attention kvpress reads
# does (the same bits); above it, blocks of queries (sums rounded otherwise).
OBSERVED_HEAD_BYTES = 256 << 20


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


def prompt_of(layer):
    if layer.prompt is None:
        raise ValueError("this scorer reads every query of the prompt, which only a prefill has "
                         "(decoding-time compression cannot use it)")
    return layer.prompt


def expected_attention(layer, epsilon: float = 0.0):
    """The attention a future query is expected to pay each entry, plus ``epsilon``, times the entry's value norm
    (kvpress 0.5.5 ``presses/expected_attention_press.py``, its defaults: covariance and value norms on, epsilon 0;
    line 160: ``(scores + epsilon) * values.norm(dim=-1)``). Future queries
    are a Gaussian fitted to the prompt's queries before rotary, the first 4 left out (lines 62-86), rotated by the
    mean rotary matrix of the next 512 positions (lines 88-124); each entry scores
    ``softmax_j(mu k_j / sqrt(d) + k_j^T Sigma k_j / 2d)`` over the entries after the sinks, averaged over the KV
    head's query heads, times ``||v_j||`` (lines 126-162); the 4 sinks score the maximum plus one (line 165). The
    rotary is the layer's own (kvpress asks the model's for the default one, which a hybrid model has not)."""
    import math

    import torch
    import torch.nn.functional as F
    prompt, sinks = prompt_of(layer), EXPECTED_SINKS
    queries = prompt.unrotated[:, sinks:].float()                                    # (H_q, s, d)
    d = queries.shape[-1]
    mean = queries.mean(dim=1, keepdim=True)
    centred = queries - mean
    cov = torch.einsum("nsi,nsj->nij", centred, centred) / queries.shape[1]          # (H_q, d, d)
    future = torch.arange(prompt.n_tokens, prompt.n_tokens + EXPECTED_FUTURE, device=queries.device)
    cos, sin = (t.float() for t in prompt.rotation(future))                         # (512, d)
    eye = torch.eye(d, device=cos.device, dtype=cos.dtype)
    half = torch.eye(d // 2, device=cos.device, dtype=cos.dtype)
    turn = torch.zeros(d, d, device=cos.device, dtype=cos.dtype)                     # turn @ q == rotate_half(q)
    turn[d // 2:, :d // 2], turn[:d // 2, d // 2:] = half, -half
    rotation = (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * turn).mean(dim=0)       # (d, d)
    mean = torch.matmul(mean.squeeze(1), rotation.T)                                  # (H_q, d)
    cov = torch.matmul(rotation, torch.matmul(cov, rotation.T))
    keys, values = layer.keys[:, sinks:].float(), layer.values[:, sinks:].float()      # (H_kv, n - sinks, d)
    n_kv, n = keys.shape[0], keys.shape[1]
    group = mean.shape[0] // n_kv
    keys = keys.repeat_interleave(group, dim=0).transpose(1, 2)                       # (H_q, d, n)
    scores = torch.matmul(mean.unsqueeze(1), keys).squeeze(1) / math.sqrt(d)
    scores += torch.einsum("hin,hij,hjn->hn", keys, cov, keys) / d / 2
    scores = F.softmax(scores, dim=-1).view(n_kv, group, n).mean(dim=1)
    scores = (scores + epsilon) * values.norm(dim=-1)
    return F.pad(scores, (sinks, 0), value=scores.max().item() + 1)


def observed_attention(layer, head_bytes: int = OBSERVED_HEAD_BYTES):
    """Each entry's attention over the prefill, summed over the queries that see it and divided by their number,
    averaged over the KV head's query heads (kvpress 0.5.5 ``presses/observed_attention_press.py`` lines 45-49: H2O's
    accumulated attention). kvpress reads the weights of an eager prefill; here the prompt's queries attend again,
    one query head at a time as the eager attention computes each (``q k^T x d^-1/2``, the causal mask, a float32
    softmax, the sum over queries in one reduction: the same bits on a float32 model whose scale is ``d^-1/2``), or,
    where a head's n x n weights would pass ``head_bytes``, a block of queries at a time (sums rounded otherwise).
    kvpress sums weights in the model's dtype; on a bf16 model these float32 sums may rank near-ties otherwise."""
    import torch
    from .scores import rows_per_chunk, window_attention
    queries, keys = prompt_of(layer).rotated, layer.keys
    n_q, n, d = queries.shape
    group = n_q // keys.shape[0]
    received = torch.zeros(n_q, n, dtype=torch.float32, device=keys.device)
    block = rows_per_chunk(head_bytes, n, torch.float32)
    if block >= n:
        future = torch.ones(n, n, dtype=torch.bool, device=keys.device).triu(1)
        for h in range(n_q):
            logits = torch.matmul(queries[h].float(), keys[h // group].float().T) * d ** -0.5
            received[h] = logits.masked_fill_(future, float("-inf")).softmax(dim=-1, dtype=torch.float32).sum(dim=0)
    else:
        block = rows_per_chunk(head_bytes, n_q * n, torch.float32)
        for start in range(0, n, block):
            end = min(start + block, n)     # queries start..end-1 see the keys before end, causally inside the block
            received[:, :end] += window_attention(queries[:, start:end], keys[:, :end]).sum(dim=1)
    received /= torch.arange(n, 0, -1, device=keys.device, dtype=torch.float32)
    return received.view(keys.shape[0], group, n).mean(dim=1)


def lagkv(layer):
    """LagKV (Liang et al., 2025): each entry scored against the partition after its own (kvpress 0.5.5
    ``presses/lagkv_press.py`` lines 45-97, its defaults: 4 sinks, partitions of 128, no cross scoring). After the
    sinks, the sequence is cut into whole partitions; in each but the last, every key and value is min-max scaled by
    the next partition's per-feature range, the spread (unbiased std) of its scaled features softmaxed over the
    partition, keys' and values' averaged; an entry scores its rank in its partition over 128. The sinks and the
    last partition with the remainder score 1, above every rank. A sequence shorter than the sinks and two partitions
    scores its sinks 1 and the rest by position (i / (n - sinks)), newest first."""
    import torch
    keys, values = layer.keys, layer.values
    h, n, d = keys.shape
    sinks, lag = LAGKV_SINKS, LAGKV_LAG
    if n < sinks + 2 * lag:
        scores = torch.ones(h, n, dtype=keys.dtype, device=keys.device)
        if n > sinks:
            scores[:, sinks:] = (torch.arange(n - sinks, device=keys.device) / (n - sinks)).to(keys.dtype)
        return scores
    end = sinks + (n - sinks) // lag * lag

    def lag_relative(states):
        parts = states[:, sinks:end].view(h, -1, lag, d)
        reference, scored = parts[:, 1:], parts[:, :-1]
        low, high = reference.min(dim=-2, keepdim=True).values, reference.max(dim=-2, keepdim=True).values
        return ((scored - low) / (high - low)).std(dim=-1).softmax(dim=-1)

    spread = (lag_relative(keys) + lag_relative(values)) / 2
    ranks = (spread.argsort(dim=-1).argsort(dim=-1) / lag).to(keys.dtype).reshape(h, -1)
    ones = torch.ones(h, 1, dtype=ranks.dtype, device=ranks.device)
    return torch.cat([ones.expand(h, sinks), ranks, ones.expand(h, lag + n - end)], dim=-1)


def cur(layer):
    """CUR (CurDKV, Sengupta et al., 2025): approximate leverage scores of keys and values (kvpress 0.5.5
    ``presses/cur_press.py`` lines 34-67, its defaults: no random projection, local approximation over windows of 16,
    ``kv_product``, 4 sinks). Each entry's squared key norm and squared value norm are each divided by their sum over
    its window of 16 (the last window zero-padded), their product divided by its sum over the head; the 4 sinks
    score 1."""
    import torch.nn.functional as F
    h, n = layer.keys.shape[:2]
    w = CUR_WINDOW

    def local(squares):
        blocks = F.pad(squares, (0, (w - n % w) % w)).reshape(h, -1, w)
        return (blocks / blocks.sum(dim=-1, keepdim=True)).reshape(h, -1)[:, :n]

    scores = local((layer.keys ** 2).sum(dim=-1)) * local((layer.values ** 2).sum(dim=-1))
    scores /= scores.sum(dim=-1, keepdim=True)
    scores[:, :CUR_SINKS] = 1.0
    return scores


SCORERS = {
    "window_attention": Scorer(window=None, signed=False),   # SnapKV's: the window's pooled attention
    "knorm": Scorer(window=None, signed=True, score=knorm),
    "keydiff": Scorer(window=None, signed=True, score=keydiff),
    "tova": Scorer(window=1, signed=False, score=tova),
    "expected_attention": Scorer(window=0, signed=False, prompt=True, sinks=EXPECTED_SINKS, score=expected_attention,
                                 epsilon=True),
    "observed_attention": Scorer(window=0, signed=False, prompt=True, score=observed_attention),
    "lagkv": Scorer(window=None, signed=False, sinks=LAGKV_SINKS, score=lagkv, positional=True),
    "cur": Scorer(window=None, signed=False, sinks=CUR_SINKS, score=cur, positional=True),
}
