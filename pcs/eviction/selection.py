"""Which prefix entries each KV head keeps, given its budget (the paper's Algorithm 1).

``attention``: top-k of the pooled window attention (SnapKV, PyramidKV and AdaKV as published).
``perturbation``: stage 1 keeps the top ``floor(alpha * B_h)`` by pooled attention; stage 2 fills the
other ``B_h - stage1`` by the perturbation score, which bounds how far the head's output can move.

Stage 2 ranks ``A x ||v W^O_h||_1``; the norm costs d x hidden multiply-adds per entry and query head, so it
is computed only for the entries that an upper bound of d^2 multiply-adds cannot rule out (``Stage2.bounded``).
The entries kept are those of scoring every entry (``exhaustive=True``, the reference the tests hold it to).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .conventions import PAPER, Conventions
from .scores import head_weights, norm_tile, projected_value_norms


@dataclass
class WindowScores:
    """Scores of one layer's prefix tokens (the n - w tokens before the observation window)."""
    mean_attention: torch.Tensor    # (H_q, m) window-mean attention, Alg. 2 line 3
    pooled_attention: torch.Tensor  # (H_q, m) after pooling, Alg. 2 line 4
    stage1: torch.Tensor            # (H_kv, m) group mean of the pooled attention
    prefix_values: torch.Tensor     # (H_kv, m, d)
    o_proj_weight: torch.Tensor     # (hidden, H_q * d)
    valid: torch.Tensor | None = None   # (H_kv, m) real entries, when heads are padded
    window: int = 0                     # the observation window, kept on top of the prefix budgets
    protected: int = 0                  # prefix entries the allocation guarantees each head (kept in stage 1)
    conventions: Conventions = PAPER    # stage-1 size and tie rule (pcs/conf/profile/)


@dataclass
class AttentionSelection:
    two_stage = False

    def select(self, budgets: list[int], ws: WindowScores) -> list[torch.Tensor]:
        return [ws.conventions.top(ws.stage1[h], b) for h, b in enumerate(budgets)]


@dataclass
class Stage2Work:
    """What stage 2 computed, summed over the layers it selected in (``pcs.bench`` reports it)."""
    entries: int = 0          # prefix entries of those heads: what exhaustive scoring computes
    exact: int = 0            # entries whose ||v W^O_h||_1 was computed (a widened head's candidates and all)
    heads: int = 0            # KV heads (rows) that chose by stage 2
    widened: int = 0          # of them, heads whose first candidates did not verify the cut (WIDENINGS)
    host_reads: int = 0       # times stage 2 waited for the device (one per layer and round)

    @property
    def exact_share(self) -> float:
        return self.exact / self.entries if self.entries else 0.0


@dataclass
class PerturbationSelection:
    """Two-stage selection. ``stage2_source``: 'unpooled' (paper, Alg. 2 line 9) or 'pooled' (released code).

    ``gqa``: how a KV head combines its query heads in stage 2. 'mean_of_products' averages
    ``A_h * N_h`` over the group (paper, per head); 'product_of_means' multiplies the group means of
    ``A`` and ``N`` (released code).
    """
    alpha: float = 0.25
    stage2_source: str = "unpooled"
    epsilon: float = 0.0
    gqa: str = "mean_of_products"
    two_stage = True

    def __post_init__(self):
        self.work = Stage2Work()

    def stage1_size(self, prefix_budget: int, window: int, rule: str) -> int:
        """Prefix entries stage 1 keeps: ``floor(alpha * B_h)`` of the head's prefix budget (``prefix``), or
        ``int(alpha * b_h)`` of its whole budget with the window counted first (``budget``: the paper's
        ``b' = b x alpha``, and the released code)."""
        if rule == "budget":
            return max(0, int(self.alpha * (prefix_budget + window)) - window)
        return int(self.alpha * prefix_budget)

    def stage1(self, budgets: list[int], ws: WindowScores) -> list[torch.Tensor]:
        """Stage 1 of Algorithm 1: per KV head, the top ``stage1_size`` prefix entries by pooled attention."""
        sizes = [max(self.stage1_size(b, ws.window, ws.conventions.stage1), min(ws.protected, b)) for b in budgets]
        return [ws.conventions.top(ws.stage1[h], size) for h, size in enumerate(sizes)]

    def select(self, budgets: list[int], ws: WindowScores, exhaustive: bool = False) -> list[torch.Tensor]:
        """Stage 1, then stage 2's top entries per KV head. ``exhaustive`` computes every entry's stage-2
        score; otherwise only the candidates the bound leaves (the same entries are kept either way)."""
        firsts = self.stage1(budgets, ws)
        counts = [b - len(first) for b, first in zip(budgets, firsts)]
        excluded = torch.zeros_like(ws.stage1, dtype=torch.bool)
        for h, first in enumerate(firsts):
            excluded[h, first] = True
        if ws.valid is not None:
            excluded |= ~ws.valid
        stage2 = Stage2(self, ws, excluded)
        scores = stage2.exhaustive() if exhaustive else stage2.bounded(counts, self.work)
        return [torch.cat([first, ws.conventions.top(scores[h], k)]).sort().values
                for h, (first, k) in enumerate(zip(firsts, counts))]

    def stage2_attention(self, ws: WindowScores) -> torch.Tensor:
        return (ws.mean_attention if self.stage2_source == "unpooled" else ws.pooled_attention) + self.epsilon

    def combine(self, attention: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """(group, n) attention and norms of one KV head's query heads -> (n,) stage-2 scores. Monotone in
        ``norms`` (attention is non-negative), so bounds on the norms give bounds on the scores."""
        if self.gqa == "mean_of_products":
            return (attention * norms).mean(dim=0)
        return attention.mean(dim=0) * norms.mean(dim=0)


# Candidates a head scores exactly, as multiples of its k (at least 64 more): the first round, then a wider one
# for the heads the first could not verify; a head neither verifies is scored exhaustively. On the embedded
# model's layers (4,096 tokens, results/bench/README.md) 2k held the top k in 97-99 % of heads under the paper's
# selection, 8k in all; the released code's pooled, flatter scores need the second round more often.
WIDENINGS = (2, 8)


class Stage2:
    """Stage 2 of one layer: ``A x ||v W^O_h||_1`` per KV head, over the entries stage 1 left
    (``excluded``: stage 1's picks and padding, scored minus infinity)."""

    def __init__(self, selection: PerturbationSelection, ws: WindowScores, excluded: torch.Tensor):
        self.selection, self.ws, self.excluded = selection, ws, excluded
        self.rows, self.m = ws.stage1.shape                     # one row per KV head (per query head if they choose apart)
        self.group = ws.mean_attention.shape[0] // self.rows    # query heads per row
        d = ws.prefix_values.shape[-1]
        self.weights = head_weights(ws.o_proj_weight, d)        # (H_q, d, hidden)
        self.attention = selection.stage2_attention(ws)         # (H_q, m)
        self.tile = norm_tile(ws.prefix_values, self.group, ws.o_proj_weight.shape[0])

    def heads(self, g: int) -> slice:
        return slice(g * self.group, (g + 1) * self.group)

    def exact(self, g: int, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Row ``g``'s stage-2 scores of entries ``idx`` (all by default)."""
        values = self.ws.prefix_values[g] if idx is None else self.ws.prefix_values[g][idx]
        attention = self.attention[self.heads(g)] if idx is None else self.attention[self.heads(g)][:, idx]
        return self.selection.combine(attention, projected_value_norms(values, self.weights[self.heads(g)], self.tile))

    def exhaustive(self) -> torch.Tensor:
        """(rows, m) every entry's score, minus infinity where excluded: the reference."""
        return torch.stack([self.exact(g) for g in range(self.rows)]).masked_fill(self.excluded, float("-inf"))

    def bound(self, g: int) -> torch.Tensor:
        """(m,) upper bounds of row ``g``'s scores, minus infinity where excluded. For ``y = v W^O_h`` of
        ``hidden`` entries, ``||y||_1 <= sqrt(hidden) ||y||_2`` and ``||y||_2^2 = v G_h v`` with the d x d Gram
        matrix ``G_h = W^O_h W^O_h^T``: d^2 multiply-adds per entry instead of d x hidden, and within ~25 % of the
        norm when y's entries are of similar size. Room is left for float32's rounding of the quadratic form and
        for the exact norm's rounding in the values' dtype."""
        weights = self.weights[self.heads(g)].float()                        # (group, d, hidden)
        gram = weights @ weights.transpose(1, 2)                             # (group, d, d)
        values = self.ws.prefix_values[g].float()                            # (m, d)
        group, d, hidden = weights.shape
        # One query head at a time, so the temporaries are one (m, d) product, not the group's.
        quadratic = torch.stack([((values @ gram[h]) * values).sum(-1) for h in range(group)])   # (group, m)
        rounding = 2 * d * torch.finfo(torch.float32).eps * gram.flatten(1).norm(dim=-1)[:, None] \
            * values.square().sum(-1)                                        # (group, m)
        norms = ((quadratic + rounding).clamp_min(0) * hidden).sqrt()        # (group, m)
        slack = (1 + torch.finfo(self.ws.prefix_values.dtype).eps) * (1 + 1e-4)
        return (self.selection.combine(self.attention[self.heads(g)], norms) * slack).masked_fill(
            self.excluded[g], float("-inf"))

    def bounded(self, counts: list[int], work: Stage2Work) -> torch.Tensor:
        """(rows, m) scores that keep what ``exhaustive`` keeps: exact for each head's candidates (its best
        bounds), minus infinity elsewhere. A head's candidates hold its top ``k`` when the k-th best exact score
        beats the best bound left out (strictly, so every entry tied with the k-th is a candidate); under
        torch.topk's tie rule a tie at the cut does not verify, as that rule's order depends on every entry. The
        heads are checked together, one read from the device per round (``WIDENINGS``); a head no round
        verifies is scored exhaustively (``work.widened`` counts the heads that needed more than one round)."""
        scores = torch.full((self.rows, self.m), float("-inf"), device=self.excluded.device)
        pending = [(g, k, self.bound(g)) for g, k in enumerate(counts) if k > 0]
        work.heads, work.entries = work.heads + len(pending), work.entries + self.m * len(pending)
        for round_, widening in enumerate(WIDENINGS):
            if not pending:
                break
            sizes = [min(self.m, max(widening * k, k + 64)) for _, k, _ in pending]
            checks = [self.candidates(g, k, bound, c, scores) for (g, k, bound), c in zip(pending, sizes)]
            verified = torch.stack(checks).tolist()                     # the round's one wait for the device
            work.host_reads += 1
            work.exact += sum(sizes)
            work.widened += 0 if round_ else verified.count(False)
            pending = [head for head, ok in zip(pending, verified) if not ok]
        for g, _, _ in pending:
            work.exact += self.m
            scores[g] = self.exact(g).masked_fill(self.excluded[g], float("-inf"))
        return scores

    def candidates(self, g: int, k: int, bound: torch.Tensor, c: int, scores: torch.Tensor) -> torch.Tensor:
        """Row ``g``'s exact scores of its ``c`` best bounds, written to ``scores``; whether they verify its cut
        (a boolean on the device)."""
        if c >= self.m:              # every entry scored: what the exhaustive path computes, nothing to verify
            scores[g] = self.exact(g).masked_fill(self.excluded[g], float("-inf"))
            return torch.ones((), dtype=torch.bool, device=bound.device)
        best, order = bound.topk(c + 1)
        exact = self.exact(g, order[:c]).masked_fill(best[:c] == float("-inf"), float("-inf"))
        scores[g, order[:c]] = exact
        top = exact.topk(min(k + 1, c)).values
        verified = best[c] < top[k - 1]
        if self.ws.conventions.ties == "topk" and c > k:
            verified &= top[k] < top[k - 1]
        return verified
