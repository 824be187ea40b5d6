"""Scores that rank cache entries: window attention (SnapKV) and the projected value norm (PCS paper, Alg. 1).

Shapes follow one layer of one sequence: keys/values are (H_kv, n, d), window queries (H_q, w, d).
Query head h reads KV head h // group, as in grouped-query attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from ..kernels import value_norms as value_norm_kernel
from ..options import Stage2Search


def positions(mask: torch.Tensor, sizes: list[int], tail: int = 0) -> list[torch.Tensor]:
    """Ascending positions of each row's True entries of (rows, m) ``mask``, ``sizes[r]`` of them (known on the
    host), then the ``tail`` positions m, m + 1, ... that every row keeps (the observation window): one stable sort
    for every row, then views."""
    if tail:
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], tail)], dim=1)
    ascending = (~mask).to(torch.uint8).sort(dim=-1, stable=True).indices
    return [ascending[r, :n + tail] for r, n in enumerate(sizes)]


def window_attention(window_queries: torch.Tensor, keys: torch.Tensor,
                     key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of the last ``w`` queries over all ``n`` keys, causal inside the window.

    Returns (H_q, w, n) in float32. This is line 3 of the paper's Algorithm 2 before the mean.
    ``key_valid`` (H_kv, n) marks real entries when heads are padded to a common length.
    """
    n_q_heads, w, d = window_queries.shape
    n_kv_heads, n, _ = keys.shape
    group = n_q_heads // n_kv_heads
    q = window_queries.float().reshape(n_kv_heads, group * w, d)
    logits = torch.bmm(q, keys.float().transpose(1, 2)).view(n_q_heads, w, n) / math.sqrt(d)
    # Window query j sits at position n - w + j and may not see keys after it.
    future = torch.ones(w, w, dtype=torch.bool, device=keys.device).triu(1)
    logits[:, :, n - w:].masked_fill_(future, float("-inf"))
    if key_valid is not None:
        logits.masked_fill_(~key_valid.repeat_interleave(group, dim=0)[:, None, :], float("-inf"))
    return logits.softmax(dim=-1)


def pool_scores(scores: torch.Tensor, kernel: int, pooling: str, count_padding: bool = False) -> torch.Tensor:
    """1-D pooling along tokens with 'same' padding (SnapKV's clustering step, Alg. 2 line 4). Average
    pooling divides edge tokens by their real neighbours, or with ``count_padding`` by the kernel
    (``F.avg_pool1d``'s default, which kvpress, official AdaKV and KVCache-Factory use)."""
    if kernel <= 1:
        return scores
    x = scores.unsqueeze(1) if scores.dim() == 2 else scores
    if pooling == "max":
        out = F.max_pool1d(x, kernel_size=kernel, stride=1, padding=kernel // 2)
    elif pooling == "avg":
        out = F.avg_pool1d(x, kernel_size=kernel, stride=1, padding=kernel // 2, count_include_pad=count_padding)
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    return out.squeeze(1) if scores.dim() == 2 else out


def group_mean(per_query_head: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Average (H_q, n) scores over each KV head's group of query heads -> (H_kv, n)."""
    n_q_heads, n = per_query_head.shape
    return per_query_head.view(n_kv_heads, n_q_heads // n_kv_heads, n).mean(dim=1)


def rows_per_chunk(budget_bytes: int, row_elements: int, dtype: torch.dtype) -> int:
    """Rows of a (rows, row_elements) product in ``dtype``, plus its float32 copy when ``dtype`` is
    narrower, that fit in ``budget_bytes`` (at least one)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_row = row_elements * (itemsize + (0 if dtype == torch.float32 else 4))
    return max(1, budget_bytes // per_row)


# Squarings of a Gram matrix in the bound of its largest eigenvalue: within d^(1 / 2^(SQUARINGS + 1)) of it.
SQUARINGS = 7


def top_eigenvalue_bound(grams: torch.Tensor) -> torch.Tensor:
    """(..., d, d) symmetric positive semi-definite matrices -> (...,) upper bounds of their largest eigenvalues:
    ``lambda_max^p <= ||G^(p/2)||_F^2`` for ``p = 2^(SQUARINGS + 1)``, by repeated squaring (renormalised each time
    so that nothing overflows). Matrix products only: no eigensolver, which would wait for a GPU."""
    tiny = torch.finfo(torch.float32).tiny
    scale = grams.flatten(-2).norm(dim=-1).clamp_min(tiny)
    x = grams / scale[..., None, None]
    log = torch.zeros_like(scale)            # log of the factor between x and (G / scale)^(2^i)
    for _ in range(SQUARINGS):
        x = x @ x
        norm = x.flatten(-2).norm(dim=-1).clamp_min(tiny)
        x = x / norm[..., None, None]
        log = 2 * log + norm.log()
    return scale * torch.exp(log / 2 ** SQUARINGS)


@dataclass(frozen=True)
class OutputProjection:
    """What the value-norm scores and bounds need of a layer's output projection, for every query head h:
    ``grams`` (H_q, d, d) float32 ``W^O_h W^O_h^T``, so that ``||v W^O_h||_2^2 = v G_h v`` (d^2 multiply-adds per
    entry instead of d x hidden); ``top_eigenvalues`` (H_q,) upper bounds of their largest eigenvalues, so
    that ``||v W^O_h||_2^2 <= lambda ||v||_2^2`` (d); ``by_input`` (d, H_q, hidden), the weight laid out so that
    any run of query heads' ``W^O_h`` side by side is a view (``group_weights``: no copy per product), in the
    weight's dtype (one more copy of the weight per layer); ``abs_row_norms`` (H_q,) float32 ``||(|W^O_h| 1)||_2``,
    what float32 rounding of ``W^O_h s`` can reach for a sign vector ``s``; ``gram_norms`` (H_q,) the Frobenius
    norms of ``grams``, what float32 rounding of ``v G_h v`` can reach per unit of ``||v||_2^2``."""
    grams: torch.Tensor
    top_eigenvalues: torch.Tensor
    by_input: torch.Tensor
    abs_row_norms: torch.Tensor
    gram_norms: torch.Tensor
    source: tuple       # what it was computed from: ``weight_identity``
    _side_by_side: dict = field(default_factory=dict, compare=False, repr=False)

    def grams_side_by_side(self, rows: int) -> torch.Tensor:
        """(rows, d, group * d): the grams of each row's ``group`` consecutive query heads side by side, what
        ``quadratic_forms`` multiplies by (made once per layout: a copy)."""
        if rows not in self._side_by_side:
            h, d, _ = self.grams.shape
            self._side_by_side[rows] = self.grams.view(rows, h // rows, d, d).permute(0, 2, 1, 3).reshape(rows, d, -1)
        return self._side_by_side[rows]


def weight_identity(weight: torch.Tensor) -> tuple:
    """What tells a weight's values apart over time: its storage, device and dtype (``Module.to`` keeps the
    Parameter object and its version but gives it new storage) and its version (an in-place change)."""
    return weight.data_ptr(), weight.device, weight.dtype, weight._version


_projections = WeakTensorKeyDictionary()


def output_projection(o_proj_weight: torch.Tensor, d: int) -> OutputProjection:
    """``OutputProjection`` of the (hidden, H_q * d) weight, computed once per weight (a model's weights do not
    change between prompts; a move to another device or dtype, or an in-place change, is seen by
    ``weight_identity``)."""
    cached = _projections.get(o_proj_weight)
    if cached is not None and cached.source == weight_identity(o_proj_weight) and cached.grams.shape[-1] == d:
        return cached
    hidden, qd = o_proj_weight.shape
    weight = o_proj_weight.detach().view(hidden, qd // d, d)
    w = weight.float()
    grams = torch.einsum("ohd,ohe->hde", w, w)
    projection = OutputProjection(grams, top_eigenvalue_bound(grams), weight.permute(2, 1, 0).contiguous(),
                                  w.abs().sum(0).norm(dim=-1), grams.flatten(1).norm(dim=-1),
                                  weight_identity(o_proj_weight))
    _projections[o_proj_weight] = projection
    return projection


def quadratic_forms(values: torch.Tensor, side_by_side: torch.Tensor, budget_bytes: int) -> torch.Tensor:
    """``v G_h v`` for (rows, n, d) value rows and each row's ``group`` matrices side by side
    (``OutputProjection.grams_side_by_side``, (rows, d, group * d)) -> (rows, group, n) float32: one batched
    product per chunk of entries, each chunk's temporaries within ``budget_bytes`` (a single chunk where they fit,
    written nowhere else)."""
    rows, d, width = side_by_side.shape
    group = width // d
    chunk = rows_per_chunk(budget_bytes, rows * 2 * group * d, torch.float32)

    def forms(v: torch.Tensor) -> torch.Tensor:
        return (torch.bmm(v, side_by_side).view(rows, -1, group, d) * v[:, :, None, :]).sum(-1).transpose(1, 2)
    if values.shape[1] <= chunk:
        return forms(values.float())
    out = torch.empty(rows, group, values.shape[1], dtype=torch.float32, device=values.device)
    for start in range(0, values.shape[1], chunk):
        out[:, :, start:start + chunk] = forms(values[:, start:start + chunk].float())
    return out


def group_weights(o_proj_weight: torch.Tensor, rows: int, d: int) -> torch.Tensor:
    """(rows, d, group * hidden): each row's query heads' slices ``W^O_h`` (d, hidden) side by side (rows of
    ``group`` consecutive query heads), a view of ``OutputProjection.by_input``, so that a batched product
    ``v @ group_weights(...)`` is every ``v W^O_h`` of every row's group at once."""
    by_input = output_projection(o_proj_weight, d).by_input                          # (d, H_q, hidden)
    return by_input.view(d, rows, -1).transpose(0, 1)


# What the products' temporaries may take on an accelerator: a 32K-token prefill of an 8B model allocates more per
# layer for its MLP alone, and a product covering each row's candidates at once saves a launch per tile.
ACCELERATOR_PRODUCT_BYTES = 1 << 30
# Entries per batched product there, at least: the bounded stage 2's first round then scores a row's whole pool (2k
# entries, at least k + 256) in one product up to k = 512, and rarely needs another round, each of which costs
# launches and a wait. The norms kernel has no tile to fill: its plan's tile is its block of entries, so the first
# round scores k + max(k / 8, 32) rounded up to its block, not the pool, and computes fewer exact norms.
ACCELERATOR_TILE = 1024


def batches_rows(device: torch.device) -> bool:
    """Whether a layer's rows go through one batched product: on an accelerator, where a launch costs more than
    the padding it brings (the bounded stage 2's rows ask for unequal numbers of entries), not on a CPU, where
    the multiply-adds are what costs."""
    return device.type != "cpu"


def scores_every_entry(n: int, device: torch.device, search: Stage2Search, bounded_share: float = 0.0,
                       bounded_layers: int = 0) -> bool:
    """Whether stage 2 scores every one of a layer's ``n`` entries under ``search`` (``pcs.options.Stage2Search``),
    where the prompt's ``bounded_layers`` bounded layers so far scored ``bounded_share`` of their entries exactly:
    only ever on an accelerator, where the bounded search's launches and waits for the device cost more than the
    norms it spares in short layers and where loose bounds spare too few; on a CPU the multiply-adds are what
    costs, and the bounds spare most of them."""
    if not batches_rows(device):
        return False
    if search.search == "auto":
        loose = bounded_layers >= search.loose_after and bounded_share > search.loose_share
        return n < search.exhaustive_below or loose
    return search.search == "exhaustive"


def stage2_search(n: int, device: torch.device, search: Stage2Search) -> str:
    """The search a prompt starts with in layers of ``n`` entries, for results rows: "exhaustive", "bounded", or
    "auto" where it bounds until the bounds prove loose (``scores_every_entry``)."""
    if scores_every_entry(n, device, search):
        return "exhaustive"
    return "auto" if search.search == "auto" and batches_rows(device) else "bounded"


@dataclass(frozen=True)
class NormPlan:
    """How ``projected_value_norms`` goes through a layer: ``together`` rows per batched product, ``tile``
    entries per product (under the norms kernel, its block: what the bounded stage 2 rounds its first candidates
    to), and ``temporaries``, the bytes the layer's other products in chunks (the bounds' quadratic
    forms) may take, the same budget as the norms': one chunk for a bounded stage 2's entries on an accelerator,
    where each chunk costs launches. ``accelerator``: the plan is for a device where a launch costs more than the
    multiply-adds it saves (``batches_rows``)."""
    together: int
    tile: int
    temporaries: int
    accelerator: bool = False
    kernel: bool = False     # the norms from ``pcs.kernels.value_norms`` (``Stage2Search.value_norm_kernel``, where
                             # it runs)
    one_reduction: bool = False   # each L1 norm one reduction (``projected_value_norms``)

    @property
    def certifies(self) -> bool:
        """Whether the bounded stage 2 keeps entries on a lower bound of their norms, without their exact score
        (its round 0): on a CPU, where it spares exact norms (docs/findings.md, stage 2's search); not on an
        accelerator, where the round's sixty-odd launches and its wait for the device cost more than the exact norms
        it spares."""
        return not self.accelerator


def norm_plan(rows: int, n: int, d: int, group: int, hidden: int, dtype: torch.dtype,
              device: torch.device, l1_norm: str = "abs_sum", kernel: bool = True) -> NormPlan:
    """The plan for a layer of ``n`` entries, its values held as ``rows`` rows of (n, d): one row at a time on a
    CPU, every row at once on an accelerator (``batches_rows``); about n / 32 entries per product (a power of
    two, at least 32; at least ``ACCELERATOR_TILE`` on an accelerator; the norms kernel's block of entries where it
    runs), at most what keeps the (together, tile, group * hidden) product, and room for a float32 copy of a
    narrower one, within half of the layer's values' bytes (on a CPU, so the temporaries stay within one layer's
    keys and values) or within ``ACCELERATOR_PRODUCT_BYTES`` (on an accelerator). Each L1 norm is one reduction on
    an accelerator, where the products' memory traffic is what costs, and on a CPU under ``l1_norm=torch_norm``
    (``Conventions.l1_norm``). ``kernel``: the norms kernel where it runs (``Stage2Search.value_norm_kernel``).
    The plan follows the layer's shape, device, that convention and that option alone: every method
    that scores the layer under it (alone or sharing a prefill, every entry or the bounded stage 2's few) computes
    an entry's norm in the same product, the same bits."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    budget = rows * n * d * itemsize // 2
    together, tile = 1, max(32, 1 << max(0, n // 32 - 1).bit_length())
    if batches_rows(device):
        together, budget, tile = rows, max(budget, ACCELERATOR_PRODUCT_BYTES), max(tile, ACCELERATOR_TILE)
    kernel = kernel and value_norm_kernel.available(device, d)
    if kernel:
        tile = value_norm_kernel.BLOCK_ENTRIES
    return NormPlan(together, min(tile, rows_per_chunk(budget, together * group * hidden, dtype)), budget,
                    batches_rows(device), kernel, batches_rows(device) or l1_norm == "torch_norm")


def projected_value_norms(values: torch.Tensor, weights: torch.Tensor, group: int, tile: int,
                          one_reduction: bool = False, kernel: bool = False) -> torch.Tensor:
    """``||v_i W^O_h||_1`` for (r, c, d) value rows ``v_i`` of r rows (KV heads, or query heads) and each row's
    ``group`` query heads' slices ``W^O_h`` side by side (``group_weights``, (r, d, group * hidden))
    -> (r, group, c) float32.

    The entries go through the product ``tile`` at a time, the last tile padded with zeros: every entry's norm
    comes from the same (r, tile, d) x (r, d, group * hidden) product whichever other entries are scored with
    it, so an entry's score does not depend on the set it is scored in (exhaustive or bounded stage 2), bit for
    bit. ``one_reduction`` (``NormPlan.one_reduction``): each L1 norm is ``torch.linalg.vector_norm(ord=1)``,
    which reads the product in its own dtype and upcasts to float32 as it goes (no float32 copy of a
    half-precision product); in float32 on a CPU it adds in order, the bits of kvpress 0.5.5's
    ``CriticalKVPress.vwl1norm`` (criticalkv_press.py lines 69-71, ``torch.norm(p=1)`` of each query head's
    product, whose rows came out the same bits here in any batch of 8 entries or more, as every tile of a layer
    of a few hundred entries is), in about three times the sum's time. Otherwise the absolute values are summed by
    ``torch.sum`` in float32 (a cascade: up to 1.3e-6 of a norm from the former, which swapped two entries at a cut
    in 2 of 65 cells of ``make conformance``). ``kernel`` (``NormPlan.kernel``): products and norms in
    ``pcs.kernels.value_norms``'s one kernel instead, no tiles.
    """
    if kernel:
        return value_norm_kernel.value_norms(values, weights, group)
    r, c, d = values.shape
    n_tiles = -(-c // tile)
    padded = values.new_zeros(r, n_tiles * tile, d)
    padded[:, :c] = values
    norms = torch.empty(r, n_tiles * tile, group, dtype=torch.float32, device=values.device)
    for start in range(0, n_tiles * tile, tile):
        # One unnamed (r, tile, group * hidden) product at a time: a named one would live on beside the next.
        product = torch.bmm(padded[:, start:start + tile], weights).view(r, tile, group, -1)
        if one_reduction:
            norms[:, start:start + tile] = torch.linalg.vector_norm(product, ord=1, dim=-1, dtype=torch.float32)
        else:           # the absolute value is exact in any dtype; the sum converts to float32 first
            norms[:, start:start + tile] = product.abs_().sum(-1, dtype=torch.float32)
        del product
    return norms[:, :c].transpose(1, 2)


class SharedScores:
    """One layer's scores that every method compressing it from the same prefill would compute alike, computed
    once, for the first method that asks: the observation window's mean attention (per window) and stage 2's
    ``||v_i W^O_h||_1`` for every entry (per number of query heads scored together: a KV head's group, or one
    under ``gqa=per_query_head``). A group of runs sharing a prefill gets one per layer (``pcs.compression``);
    a run alone has none, and its stage 2 computes only the norms its bounds cannot rule out. Both give the same
    bits: the norms come from ``norm_plan``'s products, which follow the layer's shape and device alone."""

    def __init__(self, values: torch.Tensor, o_proj_weight: torch.Tensor, kernel: bool = True):
        self.values, self.o_proj_weight = values, o_proj_weight     # (H_kv, n, d), (hidden, H_q * d)
        self.kernel = kernel      # the norms kernel where it runs (``Stage2Search.value_norm_kernel``)
        self._window_means: dict[int, torch.Tensor] = {}
        self._scorers: dict[str, torch.Tensor] = {}
        self._norms: dict[tuple[int, bool], torch.Tensor] = {}

    def window_mean(self, window: int, compute) -> torch.Tensor:
        """(H_q, n - window) mean attention of the last ``window`` queries: ``compute()`` the first time."""
        if window not in self._window_means:
            self._window_means[window] = compute()
        return self._window_means[window]

    def scorer(self, name: str, compute) -> torch.Tensor:
        """(H_kv, n) scores of the scorer ``name`` (``pcs.eviction.scorers``): ``compute()`` the first time."""
        if name not in self._scorers:
            self._scorers[name] = compute()
        return self._scorers[name]

    def value_norms(self, group: int, l1_norm: str) -> torch.Tensor:
        """(H_q, n) float32 ``||v_i W^O_h||_1`` of every entry, query heads scored ``group`` at a time, summed as
        ``l1_norm`` says (``Conventions.l1_norm``). Kept per plan, not per convention: on an accelerator both
        conventions take the same one reduction, and profiles sharing a prefill share its norms."""
        n_kv, n, d = self.values.shape
        hidden, n_q = self.o_proj_weight.shape[0], self.o_proj_weight.shape[1] // d
        rows = n_q // group
        plan = norm_plan(rows, n, d, group, hidden, self.values.dtype, self.values.device, l1_norm, self.kernel)
        key = (group, plan.one_reduction)
        if key not in self._norms:
            together = plan.together
            weights = group_weights(self.o_proj_weight, rows, d)

            def values(r: int) -> torch.Tensor:      # rows r, r + 1, ...: the KV head each row's queries read
                heads = torch.arange(r, min(r + together, rows), device=self.values.device) * n_kv // rows
                return self.values[r:r + together] if rows == n_kv else self.values[heads]
            self._norms[key] = torch.cat([
                projected_value_norms(values(r), weights[r:r + together], group, plan.tile, plan.one_reduction,
                                      plan.kernel)
                for r in range(0, rows, together)]).flatten(0, 1)
        return self._norms[key]
