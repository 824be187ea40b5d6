"""Which prefix entries each KV head keeps, given its budget (the paper's Algorithm 1).

``attention``: top-k of the pooled window attention (SnapKV, PyramidKV and AdaKV as published).
``perturbation``: stage 1 keeps the top ``floor(alpha * B_h)`` by pooled attention; stage 2 fills the
other ``B_h - stage1`` by the perturbation score, which bounds how far the head's output can move.

Stage 2 ranks ``A x ||v W^O_h||_1``; the norm costs d x hidden multiply-adds per entry and query head, so it
is computed only for the entries that two upper bounds cannot rule out (``Stage2.bounded``): one of d
multiply-adds per entry for every entry, one of d^2 for the entries the first leaves. The entries kept are
those of scoring every entry (``exhaustive=True``, the reference the tests hold it to).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .conventions import PAPER, Conventions
from .scores import SharedScores, group_weights, norm_tile, output_projection, projected_value_norms, \
    quadratic_forms


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
    shared: SharedScores | None = None  # the layer's scores computed once for the runs sharing its prefill


@dataclass
class AttentionSelection:
    two_stage = False

    def select(self, budgets: list[int], ws: WindowScores) -> list[torch.Tensor]:
        return [ws.conventions.top(ws.stage1[h], b) for h, b in enumerate(budgets)]


@dataclass
class Stage2Work:
    """What stage 2 computed, summed over the layers it selected in (``pcs.bench`` reports it)."""
    entries: int = 0          # prefix entries of those heads: what exhaustive scoring computes
    exact: int = 0            # entries whose ||v W^O_h||_1 was computed
    certified: int = 0        # entries kept on their lower bound alone, without an exact norm
    gram: int = 0             # entries whose d^2 bound was computed (the d bound is computed for every entry)
    heads: int = 0            # KV heads (rows) that chose by stage 2
    widened: int = 0          # of them, heads whose first candidates left entries to score (a second round)
    host_reads: int = 0       # times stage 2 waited for the device
    layers: int = 0           # layers it selected in

    @property
    def exact_share(self) -> float:
        return self.exact / self.entries if self.entries else 0.0

    @property
    def gram_share(self) -> float:
        return self.gram / self.entries if self.entries else 0.0

    @property
    def certified_share(self) -> float:
        return self.certified / self.entries if self.entries else 0.0


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
        # One scatter for every head's stage-1 picks: a per-head ``excluded[h, first] = True`` copies its True from
        # the host and waits for the device at each head (8 of a layer's 12 waits on a GPU, results/bench).
        m = ws.stage1.shape[-1]
        flat = torch.cat([first + h * m for h, first in enumerate(firsts)])
        excluded = torch.zeros(ws.stage1.numel(), dtype=torch.bool, device=ws.stage1.device).index_fill_(0, flat, True) \
            .view(ws.stage1.shape)
        if ws.valid is not None:
            excluded |= ~ws.valid
        stage2 = Stage2(self, ws, excluded, counts)
        # Norms shared by the runs of a prefill are computed for every entry anyway: no bound can save work.
        scores = stage2.exhaustive() if exhaustive or stage2.shared_norms is not None else stage2.bounded(self.work)
        return [torch.cat([first, ws.conventions.top(scores[h], k)]).sort().values
                for h, (first, k) in enumerate(zip(firsts, counts))]

    def stage2_attention(self, ws: WindowScores) -> torch.Tensor:
        return (ws.mean_attention if self.stage2_source == "unpooled" else ws.pooled_attention) + self.epsilon

    def combine(self, attention: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """(..., group, n) attention and norms of KV heads' query heads -> (..., n) stage-2 scores. Monotone in
        ``norms`` (attention is non-negative), so bounds on the norms give bounds on the scores."""
        if self.gqa == "mean_of_products":
            return (attention * norms).mean(dim=-2)
        return attention.mean(dim=-2) * norms.mean(dim=-2)


# Stage 2's first round, per KV head with k entries to choose: its best POOL x k entries (at least k + 256) by the
# d-multiply-add bound get the d^2 bound, and its best k + max(k / 8, 32) of those by that bound their exact norm.
# On the embedded model's layers (4,096 tokens, results/bench/README.md) the exact top k lay within 1.2-1.5 k
# entries of the d^2 bound's order at the median and within 1.6-2.4 k of the d bound's (6-7 k for the released
# code's flatter scores at budget 1,024); later rounds bound and score whatever the first could not rule out.
POOL = 2


# Relative room for rounding, on top of the values' dtype's: the bounds' float32 arithmetic (at most ~1e-5 of the
# bound on these shapes) and the exact norm's float32 sums (hidden terms).
ROUNDING = 1e-3


# Values per row that choose the sign vectors of the lower bound (Stage2.sign_projections).
SIGN_SAMPLE = 512


def first_candidates(k: int) -> int:
    return k + max(k // 8, 32)


class Stage2:
    """Stage 2 of one layer: ``A x ||v W^O_h||_1`` per KV head, over the entries stage 1 left
    (``excluded``: stage 1's picks and padding, scored minus infinity), ``counts[r]`` entries for row r. One row
    per KV head (per query head where query heads choose apart)."""
    MOST_READS = 4   # host reads per layer: the entries certified, rounds 1 and 2, and under torch.topk's tie rule
                     # a re-check of the cut

    def __init__(self, selection: PerturbationSelection, ws: WindowScores, excluded: torch.Tensor, counts: list[int]):
        self.selection, self.ws, self.excluded, self.counts = selection, ws, excluded, counts
        self.rows, self.m = excluded.shape
        self.group = ws.mean_attention.shape[0] // self.rows    # query heads per row
        d = ws.prefix_values.shape[-1]
        self.hidden = ws.o_proj_weight.shape[0]
        self.attention = selection.stage2_attention(ws).view(self.rows, self.group, self.m)
        # The same for the exhaustive and the bounded path, alone or shared: an entry's exact score is the same
        # bits in all.
        self.tile = norm_tile(self.rows, self.m + ws.window, d, self.group, self.hidden, ws.prefix_values.dtype)
        self.shared_norms = None if ws.shared is None else \
            ws.shared.value_norms(self.group)[:, :self.m].view(self.rows, self.group, self.m)
        self.slack = (1 + torch.finfo(ws.prefix_values.dtype).eps) * (1 + ROUNDING)
        self._signs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def exact(self, r: int, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Row ``r``'s stage-2 scores of entries ``idx`` (all by default)."""
        attention = self.attention[r] if idx is None else self.attention[r][:, idx]
        if self.shared_norms is not None:
            norms = self.shared_norms[r] if idx is None else self.shared_norms[r][:, idx]
        else:
            values = self.ws.prefix_values[r] if idx is None else self.ws.prefix_values[r][idx]
            weights = group_weights(self.ws.o_proj_weight, self.heads(r), values.shape[-1])  # (d, group * hidden)
            norms = projected_value_norms(values, weights, self.group, self.tile)
        return self.selection.combine(attention, norms)

    def heads(self, r: int) -> slice:
        return slice(r * self.group, (r + 1) * self.group)

    def exhaustive(self) -> torch.Tensor:
        """(rows, m) every entry's score, minus infinity where excluded: the reference."""
        return torch.stack([self.exact(r) for r in range(self.rows)]).masked_fill(self.excluded, float("-inf"))

    def spectral_bounds(self) -> torch.Tensor:
        """(rows, m) upper bounds of every entry's score: ``||y||_1 <= sqrt(hidden) ||y||_2`` for the ``hidden``
        entries of ``y = v W^O_h``, and ``||v W^O_h||_2^2 <= lambda_max(G_h) ||v||_2^2``: d multiply-adds per
        entry, shared by the group's query heads."""
        projection = output_projection(self.ws.o_proj_weight, self.ws.prefix_values.shape[-1])
        squares = self.ws.prefix_values.float().square().sum(-1)                          # (rows, m)
        eigenvalues = projection.top_eigenvalues.view(self.rows, self.group, 1)
        norms = (self.hidden * eigenvalues * squares[:, None, :]).sqrt()                  # (rows, group, m)
        return (self.selection.combine(self.attention, norms) * self.slack).masked_fill(self.excluded, float("-inf"))

    def sign_projections(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(group, J, d) vectors ``u = W^O_h s`` for sign vectors ``s`` (|s . y| <= ||y||_1 for any of them, so
        ``|v . u|`` bounds ``||v W^O_h||_1`` from below in d multiply-adds), and (group, J) the room their float32
        rounding needs per unit of ``||v||``. The signs are those of the outputs of row ``r``'s mean value and of
        that mean one standard deviation either way along its values' first principal component (4 power
        iterations on their covariance: no eigensolver, no wait for a GPU): value vectors share much of their
        direction, so an entry's output mostly has one of these sign patterns and the bound comes close to its
        norm."""
        if r not in self._signs:
            d = self.ws.prefix_values.shape[-1]
            eps = torch.finfo(torch.float32).eps
            projection = output_projection(self.ws.o_proj_weight, d)
            w = projection.by_input[:, self.heads(r)].float().transpose(0, 1)                # (group, d, hidden)
            # The directions only choose which sign vectors to use (any gives a valid bound): the mean and the
            # (d, d) covariance of an evenly spaced sample of at most SIGN_SAMPLE values choose them as well.
            values = self.ws.prefix_values[r][::max(1, -(-self.m // SIGN_SAMPLE))].float()
            mean = values.mean(0)
            centred = values - mean
            covariance = centred.T @ centred / max(1, len(values) - 1)
            component = torch.ones(d, device=values.device)
            for _ in range(4):
                component = covariance @ component
                component = component / component.norm().clamp_min(torch.finfo(torch.float32).tiny)
            spread = (component @ covariance @ component).clamp_min(0).sqrt()
            directions = torch.stack([mean, mean + spread * component, mean - spread * component])  # (J, d)
            signs = torch.einsum("jd,gdo->gjo", directions, w).sign()                         # (group, J, hidden)
            u = torch.einsum("gdo,gjo->gjd", w, signs)                                        # (group, J, d)
            # |fl(v . u) - v . s W| <= ||v|| (||fl(u) - u|| + d eps ||u||), ||fl(u) - u|| <= hidden eps ||(|W| 1)||
            room = (self.hidden * eps * projection.abs_row_norms[self.heads(r)])[:, None] + d * eps * u.norm(dim=-1)
            self._signs[r] = u, 2 * room
        return self._signs[r]

    def gram_bounds(self, r: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``r``'s entries ``idx``: (c,) upper bounds of their scores, and (group, c) lower bounds of their
        norms, from ``||y||_2`` with ``||y||_2^2 = v G_h v`` (d^2 multiply-adds per entry and query head):
        ``sqrt(hidden) ||y||_2`` above, within ~25 % of ``||y||_1`` when y's entries are of similar size, and
        ``||y||_2`` below. Room is left for float32's rounding of each and of the exact scores."""
        d = self.ws.prefix_values.shape[-1]
        grams = output_projection(self.ws.o_proj_weight, d).grams[self.heads(r)]          # (group, d, d)
        rounding = 2 * d * torch.finfo(torch.float32).eps * grams.flatten(1).norm(dim=-1)  # (group,)
        values = self.ws.prefix_values[r][idx]                                            # (c, d)
        quadratic = quadratic_forms(values, grams, self.ws.prefix_values.nbytes // 2)     # (group, c)
        room = rounding[:, None] * values.float().square().sum(-1)
        upper = ((quadratic + room).clamp_min(0) * self.hidden).sqrt()
        return self.selection.combine(self.attention[r][:, idx], upper) * self.slack, (quadratic - room).clamp_min(0).sqrt()

    def lower_bounds(self, r: int, idx: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """(c,) lower bounds of row ``r``'s scores of entries ``idx``: per query head the larger of ``norms``
        (``gram_bounds``' ``||y||_2``) and ``sign_projections``' ``|v . u|`` (J d multiply-adds per entry and
        query head, less room for float32's rounding)."""
        u, u_room = self.sign_projections(r)
        values = self.ws.prefix_values[r][idx].float()                                    # (c, d)
        dots = torch.einsum("cd,gjd->gjc", values, u).abs() - u_room[:, :, None] * values.norm(dim=-1)
        norms = torch.maximum(norms, dots.amax(1).clamp_min(0))
        return self.selection.combine(self.attention[r][:, idx], norms) / self.slack

    def bounded(self, work: Stage2Work) -> torch.Tensor:
        """(rows, m) scores that keep what ``exhaustive`` keeps: exact for every entry that can reach its row's
        top ``k``, minus infinity elsewhere. Per row, with k entries to choose:

        0. Its best ``POOL x k`` entries by the d bound get the d^2 bound, and the k - 1 best of those by it a
           lower bound. An entry whose lower bound beats the row's k-th best upper bound is kept without its exact
           score: only the k - 1 entries above that could outscore it. One read for all rows: how many each has
           so (c).
        1. The best of the rest of the pool by the upper bound (``first_candidates`` of k - c, rounded up to
           whole products) get their exact scores. With the c kept, their (k - c)-th best, the cut, is at most the
           row's true k-th best score, so an entry whose bound falls below it cannot reach the top k. One read
           for all rows: how many entries of the pool have a d^2 bound that reaches the cut, and how many outside
           it a d bound that does.
        2. The first are scored exactly; the second get the d^2 bound. One read: how many of them reach the cut.
        3. Those are scored exactly.
        Every entry tied with the k-th best is scored, so the stable tie rule picks as over all entries; under
        torch.topk's rule, whose order among ties depends on every entry, a row with a tie at the cut is scored
        exhaustively (a last read, when that rule applies and a row needed round 2)."""
        inf = float("-inf")
        scores = torch.full((self.rows, self.m), inf, device=self.excluded.device)
        live = [r for r, k in enumerate(self.counts) if k > 0]
        if not live:
            return scores
        pools = [min(self.m, max(POOL * k, k + 256)) for k in self.counts]
        work.heads, work.entries, work.layers = work.heads + len(live), work.entries + self.m * len(live), work.layers + 1

        # Round 0: the d^2 bounds where computed (each row's pool), the d bound elsewhere; the entries certified.
        # Only an entry whose upper bound beats the row's k-th best can have a lower bound that does: the sign
        # vectors' bounds are computed for the k - 1 best of the pool by the upper bound alone.
        spectral = self.spectral_bounds()                                                 # (rows, m)
        bound, pool = spectral.topk(max(pools), dim=-1)
        bound, lower = bound.clone(), torch.full_like(bound, inf)
        norms = {}
        for r in live:
            upper, norms[r] = self.gram_bounds(r, pool[r, :pools[r]])
            bound[r, :pools[r]] = torch.minimum(bound[r, :pools[r]], upper)
            work.gram += pools[r]
        kth_upper = self.cuts(spectral.scatter(1, pool, bound))                           # (rows, 1)
        for r in live:
            if self.counts[r] > 1:
                best = bound[r, :pools[r]].topk(min(self.counts[r] - 1, pools[r])).indices
                lower[r, best] = self.lower_bounds(r, pool[r, best], norms[r][:, best])
        lower.masked_fill_(self.excluded.gather(1, pool), inf)
        certified = lower > kth_upper                                                     # (rows, max(pools))
        kept = self.read(work, certified.sum(-1))[0]
        work.certified += sum(kept)
        scores.scatter_(1, pool, torch.where(certified, float("inf"), inf))
        bound.masked_fill_(certified, inf)

        # Round 1: exact scores for the best of the rest by the upper bounds.
        sizes = [min(pool_size - c, -(-first_candidates(k - c) // self.tile) * self.tile)
                 for k, c, pool_size in zip(self.counts, kept, pools)]
        candidates = pool.gather(1, bound.topk(max(sizes), dim=-1).indices)               # (rows, max(sizes))
        for r in live:
            if sizes[r]:
                scores[r, candidates[r, :sizes[r]]] = self.exact(r, candidates[r, :sizes[r]])
                work.exact += sizes[r]
        scores.masked_fill_(self.excluded, inf)
        cut = self.cuts(scores)                                                           # (rows, 1)
        open_ = ~self.excluded & (scores == inf)                                          # not ruled out, not scored
        in_pool = torch.stack([torch.arange(max(pools), device=pool.device) < n for n in pools])
        to_score = torch.zeros_like(open_).scatter_(1, pool, (bound >= cut) & in_pool) & open_
        to_bound = (spectral >= cut) & open_ & ~torch.zeros_like(open_).scatter_(1, pool, in_pool)
        topk_rule = self.ws.conventions.ties == "topk"
        reads = self.read(work, to_score.sum(-1), to_bound.sum(-1), *([self.ties(scores)] if topk_rule else []))
        rows = [r for r in live if not (topk_rule and reads[2][r])]
        for r in set(live) - set(rows):
            self.score_every_entry(r, scores, work)

        # Round 2.
        reaching = {}
        for r in rows:
            if reads[0][r]:
                self.score_some(r, self.marked(to_score[r], reads[0][r]), scores, work)
            if reads[1][r]:
                idx = self.marked(to_bound[r], reads[1][r])
                reaching[r] = idx, self.gram_bounds(r, idx)[0] >= cut[r]
                work.gram += reads[1][r]
        if reaching:
            more = self.read(work, *[reach.sum() for _, reach in reaching.values()])
            # Round 3.
            for (r, (idx, reach)), n in zip(reaching.items(), more):
                if n:
                    self.score_some(r, idx[self.marked(reach, n)], scores, work)
        rescored = [r for r in rows if reads[0][r] or reads[1][r]]
        work.widened += len(rescored)
        if topk_rule and rescored:    # the later rounds may have moved the cut onto a tie
            tied = self.read(work, self.ties(scores))[0]
            for r in rescored:
                if tied[r]:
                    self.score_every_entry(r, scores, work)
        return scores

    def cuts(self, scores: torch.Tensor) -> torch.Tensor:
        """(rows, 1) each row's k-th best score in ``scores``."""
        best = scores.topk(min(max(self.counts), self.m), dim=-1).values
        return torch.stack([best[r, max(k, 1) - 1] for r, k in enumerate(self.counts)])[:, None]

    def ties(self, scores: torch.Tensor) -> torch.Tensor:
        """(rows,) whether each row's k-th and (k+1)-th best scores in ``scores`` are equal (and finite)."""
        best = scores.topk(min(max(self.counts) + 1, self.m), dim=-1).values
        tied = [(best[r, k] == best[r, k - 1]) & (best[r, k] > float("-inf")) if 0 < k < best.shape[1]
                else torch.zeros((), dtype=torch.bool, device=scores.device) for r, k in enumerate(self.counts)]
        return torch.stack(tied)

    @staticmethod
    def read(work: Stage2Work, *values: torch.Tensor) -> list:
        """The host's one wait for the device in a round: every count or flag at once."""
        work.host_reads += 1
        return torch.stack([x.long() for x in values]).tolist()

    @staticmethod
    def marked(mask: torch.Tensor, n: int) -> torch.Tensor:
        """Positions of the ``n`` True entries of a 1-D ``mask`` (``n`` read before: no wait for the device)."""
        return mask.float().topk(n).indices

    def score_some(self, r: int, idx: torch.Tensor, scores: torch.Tensor, work: Stage2Work) -> None:
        scores[r, idx] = self.exact(r, idx)
        work.exact += len(idx)

    def score_every_entry(self, r: int, scores: torch.Tensor, work: Stage2Work) -> None:
        scores[r] = self.exact(r).masked_fill(self.excluded[r], float("-inf"))
        work.exact += self.m
