"""How stage 2 of perturbation selection finds each head's top entries without scoring them all.

Stage 2 (``PerturbationSelection.stage2_scores``) ranks ``A x ||v W^O_h||_1``; the norm costs d x hidden
multiply-adds per entry and query head, so ``Stage2.bounded`` computes it only for the entries that two upper
bounds cannot rule out: one of d multiply-adds per entry for every entry, one of d^2 for the entries the first
leaves (and, on a CPU, a lower bound that keeps some entries without their norm). It keeps exactly the entries of
scoring every entry (``Stage2.exhaustive``), ties included under each profile's rule: ``tests/test_selection.py``
holds the two equal for every method, profile and GQA mode, and ``tests/test_algorithm1.py`` both equal to the
paper's algorithm as ``pcs.eviction.algorithm1`` defines it. ``Stage2.search`` picks
between them per layer as ``pcs.options.Stage2Search`` says; ``Stage2Work`` counts what a prompt's stage 2
computed, and is all the search remembers between layers (never between prompts). ``Stage2Run`` holds the two for
one prompt of one cell: the engine hands it to a method beside the layer, which holds tensors only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import value_norms as value_norm_kernel
from ..options import Stage2Search, defaults
from ..tensor_rows import rows_at
from ..upload import upload
from .scores import group_weights, norm_plan, output_projection, projected_value_norms, quadratic_forms, \
    scores_every_entry


@dataclass
class Stage2Work:
    """What stage 2 computed for one prompt of one cell, summed over the layers it selected in: what the ``auto``
    search judges the bounds by, and what ``pcs.bench`` reports (``PrefillStats.stage2``)."""
    entries: int = 0          # prefix entries of those heads: what exhaustive scoring computes
    exact: int = 0            # norms ||v W^O_h||_1 computed (an entry rescored with its whole row counts again)
    certified: int = 0        # entries kept on their lower bound alone, without an exact norm
    gram: int = 0             # entries whose d^2 bound was computed (the d bound is computed for every entry)
    heads: int = 0            # KV heads (rows) that chose by stage 2
    widened: int = 0          # of them, heads whose first candidates left entries to score (a second round)
    every_entry: int = 0      # of ``entries``, those of layers whose search scored every entry (``exact`` too)
    every_entry_layers: int = 0   # of ``layers``, those
    host_reads: int = 0       # times stage 2 waited for the device
    layers: int = 0           # layers it selected in

    def add_layer(self, heads: int, m: int) -> None:
        """A layer in which ``heads`` rows of ``m`` prefix entries chose by stage 2."""
        self.heads, self.entries, self.layers = self.heads + heads, self.entries + m * heads, self.layers + 1

    def add_every_entry_layer(self, heads: int, m: int) -> None:
        """A layer in which stage 2 computed the norm of every one of its ``heads`` rows' ``m`` prefix entries."""
        self.add_layer(heads, m)
        self.exact, self.every_entry, self.every_entry_layers = (self.exact + m * heads, self.every_entry + m * heads,
                                                                 self.every_entry_layers + 1)

    @property
    def exact_share(self) -> float:
        return self.exact / self.entries if self.entries else 0.0

    @property
    def bounded_share(self) -> float:
        """The share of the bounded layers' entries whose exact norm was computed: how loose the bounds are."""
        entries = self.entries - self.every_entry
        return (self.exact - self.every_entry) / entries if entries else 0.0

    @property
    def every_entry_share(self) -> float:
        return self.every_entry / self.entries if self.entries else 0.0

    @property
    def gram_share(self) -> float:
        return self.gram / self.entries if self.entries else 0.0

    @property
    def certified_share(self) -> float:
        return self.certified / self.entries if self.entries else 0.0


@dataclass
class Stage2Run:
    """Stage 2 for one prompt of one cell: how it searches (the engine's ``engine.stage2``) and what it computed
    (the prompt's tally, which the ``auto`` search reads back and ``pcs.bench`` reports)."""
    search: Stage2Search = field(default_factory=lambda: defaults().stage2)
    work: Stage2Work = field(default_factory=Stage2Work)


# Stage 2's first round, per KV head with k entries to choose: its best POOL x k entries (at least k + 256) by the
# d-multiply-add bound get the d^2 bound, and its best k + max(k / 8, 32) of those by that bound their exact norm.
# On real layers the exact top k lies within about 1.5 k entries of the d^2 bound's order and about 2.5 k of the d
# bound's (docs/findings.md, stage 2's search); later rounds bound and score whatever the first could not rule out.
POOL = 2
# On an accelerator, 4 x k: the d^2 bound costs little there beside a round's launches and wait, and the wider pool
# spares most second rounds (one device read fewer per layer for about as many exact norms).
ACCELERATOR_POOL = 4


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
    per KV head (per query head where query heads choose apart). Every step works on all rows at once, in a
    few batched products whatever the number of heads: on a GPU a launch costs more than the products of the
    few entries a bound leaves, so the per-row loops would set the pace."""
    MOST_READS = 4   # host reads per layer: the entries certified (where the plan certifies), rounds 1 and 2, and
                     # under torch.topk's tie rule a re-check of the cut

    def __init__(self, selection, ws, excluded: torch.Tensor, counts: list[int], norm_kernel: bool = True):
        """``selection``: the ``PerturbationSelection`` whose stage 2 this is; ``ws``: the layer's ``WindowScores``
        (the selection module's: this module stays below it); ``norm_kernel``: the exact norms from the norms
        kernel where it runs (``Stage2Search.value_norm_kernel``)."""
        self.selection, self.ws, self.excluded, self.counts = selection, ws, excluded, counts
        self.rows, self.m = excluded.shape
        self.d = ws.prefix_values.shape[-1]
        self.group = ws.o_proj_weight.shape[1] // self.d // self.rows    # query heads per row
        self.hidden = ws.o_proj_weight.shape[0]
        self.device = excluded.device
        # (rows, group, m): per query head; (rows, 1, m) where one score stands for the row's query heads (a scorer's)
        self.attention = selection.stage2_attention(ws).view(self.rows, -1, self.m)
        # The same for the exhaustive and the bounded path, alone or shared: an entry's exact score is the same
        # bits in all.
        plan = norm_plan(self.rows, self.m + ws.window, self.d, self.group, self.hidden, ws.prefix_values.dtype,
                         self.device, ws.conventions.l1_norm, norm_kernel)
        self.plan = plan
        self.shared_norms = None if ws.shared is None else \
            ws.shared.value_norms(self.group, ws.conventions.l1_norm)[:, :self.m].view(self.rows, self.group, self.m)
        self.slack = (1 + torch.finfo(ws.prefix_values.dtype).eps) * (1 + ROUNDING)
        self.k = upload(counts, self.device)                                                        # (rows,)
        self._signs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._columns: torch.Tensor | None = None     # 0, 1, ..., m - 1: what ``below`` compares with

    def below(self, sizes: list[int], width: int) -> torch.Tensor:
        """(rows, width) True at each row's first ``sizes[r]`` positions (width at most m)."""
        if self._columns is None:
            self._columns = torch.arange(self.m, device=self.device)
        return self._columns[:width] < upload(sizes, self.device)[:, None]

    def at(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``x`` (rows, ..., m) at entries ``idx`` (rows, c) of each row -> (rows, ..., c)."""
        if x.dim() == 2:
            return x.gather(1, idx)
        return x.gather(-1, idx.view(self.rows, *[1] * (x.dim() - 2), -1).expand(*x.shape[:-1], -1))

    def values_at(self, idx: torch.Tensor) -> torch.Tensor:
        """(rows, c, d) value vectors of entries ``idx`` (rows, c): one gather kernel under an accelerator's plan
        (also where the plan is forced on a CPU, so that its operations are counted as a GPU dispatches them), rows
        picked from a view of the values on a CPU (``rows_at``)."""
        if self.plan.accelerator:
            return self.ws.prefix_values.gather(1, idx[..., None].expand(-1, -1, self.d))
        return rows_at(self.ws.prefix_values, idx)

    def norms(self, idx: torch.Tensor | None = None, sizes: list[int] | None = None) -> torch.Tensor:
        """(rows, group, c) ``||v W^O_h||_1`` of entries ``idx`` (rows, c) (every entry by default) for each row's
        query heads. With ``sizes``, only each row's first ``sizes[r]`` are asked for: the norms kernel computes
        those, a batch of rows in products up to its largest; the rest is to be discarded. An entry's norm is the
        same bits whichever entries it is computed with (``norm_plan``)."""
        if self.shared_norms is not None:
            return self.shared_norms if idx is None else self.at(self.shared_norms, idx)
        values = self.ws.prefix_values if idx is None else self.values_at(idx)
        weights = group_weights(self.ws.o_proj_weight, self.rows, self.d)               # (rows, d, group * hidden)
        width = values.shape[1]
        if self.plan.kernel:        # one launch for every row, each row's blocks past its size computing nothing
            asked = None if sizes is None or min(sizes) == width else upload(sizes, self.device)
            return value_norm_kernel.value_norms(values, weights, self.group, asked)
        if self.plan.together >= self.rows and (sizes is None or max(sizes) == width):   # one product, no copy
            return projected_value_norms(values, weights, self.group, self.plan.tile, self.plan.one_reduction)
        norms = torch.zeros(self.rows, self.group, width, device=self.device)
        for r in range(0, self.rows, self.plan.together):
            rows = slice(r, r + self.plan.together)
            n = width if sizes is None else max(sizes[rows])
            if n:
                norms[rows, :, :n] = projected_value_norms(values[rows, :n], weights[rows], self.group,
                                                           self.plan.tile, self.plan.one_reduction)
        return norms

    def exact(self, idx: torch.Tensor | None = None, sizes: list[int] | None = None) -> torch.Tensor:
        """(rows, c) stage-2 scores of entries ``idx`` (rows, c) (every entry by default), ``norms``' ``sizes``."""
        attention = self.attention if idx is None else self.at(self.attention, idx)
        return self.selection.combine(attention, self.norms(idx, sizes))

    def search(self, search: Stage2Search, work: Stage2Work) -> torch.Tensor:
        """(rows, m) scores that keep what ``exhaustive`` keeps, by the search ``search`` makes in this layer
        (``scores_every_entry``: the layer's length, the device, how loose the prompt's bounds were so far, as
        ``work`` has counted them), counted in ``work``."""
        if scores_every_entry(self.m + self.ws.window, self.device, search, work.bounded_share,
                              work.layers - work.every_entry_layers):
            return self.exhaustive(work)
        return self.bounded(work)

    def exhaustive(self, work: Stage2Work | None = None) -> torch.Tensor:
        """(rows, m) every entry's score as the selection defines it (``PerturbationSelection.stage2_scores``),
        minus infinity where excluded: the reference. ``work`` counts it where it is the search a prompt made."""
        if work is not None:
            live = sum(k > 0 for k in self.counts)
            if not live:            # nothing to choose: no work, as the bounded search counts it
                return torch.full((self.rows, self.m), float("-inf"), device=self.device)
            work.add_every_entry_layer(live, self.m)
        return self.selection.stage2_scores(self.ws, self.excluded, self.norms())

    def spectral_bounds(self) -> torch.Tensor:
        """(rows, m) upper bounds of every entry's score: ``||y||_1 <= sqrt(hidden) ||y||_2`` for the ``hidden``
        entries of ``y = v W^O_h``, and ``||v W^O_h||_2^2 <= lambda_max(G_h) ||v||_2^2``: d multiply-adds per
        entry, shared by the group's query heads."""
        projection = output_projection(self.ws.o_proj_weight, self.d)
        lengths = torch.linalg.vector_norm(self.ws.prefix_values, dim=-1, dtype=torch.float32)   # (rows, m)
        scales = (self.hidden * projection.top_eigenvalues).sqrt().view(self.rows, self.group, 1)
        norms = scales * lengths[:, None, :]                                              # (rows, group, m)
        return (self.selection.combine(self.attention, norms) * self.slack).masked_fill(self.excluded, float("-inf"))

    def sign_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, group, J, d) vectors ``u = W^O_h s`` for sign vectors ``s`` (|s . y| <= ||y||_1 for any of them,
        so ``|v . u|`` bounds ``||v W^O_h||_1`` from below in d multiply-adds), and (rows, group, J) the room their
        float32 rounding needs per unit of ``||v||``. The signs are those of the outputs of each row's mean value
        and of that mean one standard deviation either way along its values' first principal component (8 power
        iterations on their covariance: no eigensolver, no wait for a GPU): value vectors share much of their
        direction, so an entry's output mostly has one of these sign patterns and the bound comes close to its
        norm."""
        if self._signs is None:
            d, eps = self.d, torch.finfo(torch.float32).eps
            projection = output_projection(self.ws.o_proj_weight, d)
            w = projection.by_input.float().view(d, self.rows, self.group, self.hidden).permute(1, 2, 0, 3)
            # The directions only choose which sign vectors to use (any gives a valid bound): the mean and the
            # (d, d) covariance of an evenly spaced sample of at most SIGN_SAMPLE values choose them as well.
            values = self.ws.prefix_values[:, ::max(1, -(-self.m // SIGN_SAMPLE))].float()    # (rows, s, d)
            mean = values.mean(1)
            centred = values - mean[:, None]
            covariance = centred.transpose(1, 2) @ centred / max(1, values.shape[1] - 1)  # (rows, d, d)
            # 8 power iterations from the ones vector: covariance^8 by three squarings of the covariance scaled
            # to unit Frobenius norm (eigenvalues at most 1, the largest at least d^-1/2: nothing overflows, and
            # the top one's eighth power is at least d^-4), then one product.
            tiny = torch.finfo(torch.float32).tiny
            power = covariance / covariance.flatten(1).norm(dim=1).clamp_min(tiny)[:, None, None]
            for _ in range(3):
                power = power @ power
            component = power.sum(-1, keepdim=True)                                    # power @ ones
            component = component / component.norm(dim=1, keepdim=True).clamp_min(tiny)
            spread = (component.transpose(1, 2) @ covariance @ component).clamp_min(0).sqrt()[:, 0]   # (rows, 1)
            component = component[..., 0]
            directions = torch.stack([mean, mean + spread * component, mean - spread * component], 1)  # (rows, J, d)
            signs = torch.einsum("rjd,rgdo->rgjo", directions, w).sign()                  # (rows, group, J, hidden)
            u = torch.einsum("rgdo,rgjo->rgjd", w, signs)                                 # (rows, group, J, d)
            # |fl(v . u) - v . s W| <= ||v|| (||fl(u) - u|| + d eps ||u||), ||fl(u) - u|| <= hidden eps ||(|W| 1)||
            rounding = self.hidden * eps * projection.abs_row_norms.view(self.rows, self.group)
            room = rounding[..., None] + d * eps * u.norm(dim=-1)
            self._signs = u, 2 * room
        return self._signs

    def gram_bounds(self, idx: torch.Tensor, sizes: list[int],
                    lower: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Entries ``idx`` (rows, c), the first ``sizes[r]`` of row r asked for: (rows, c) upper bounds of their
        scores, and with ``lower`` (rows, group, c) lower bounds of their norms, from ``||y||_2`` with
        ``||y||_2^2 = v G_h v`` (d^2 multiply-adds per entry and query head): ``sqrt(hidden) ||y||_2`` above,
        within ~25 % of ``||y||_1`` when y's entries are of similar size, and ``||y||_2`` below. Room is left for
        float32's rounding of each and of the exact scores. Bounds of entries not asked for mean nothing: on a
        CPU they are not computed (rows ask for unequal numbers, AdaKV's most), on an accelerator each row pads to
        the largest, as the exact products do."""
        projection = output_projection(self.ws.o_proj_weight, self.d)
        rounding = 2 * self.d * torch.finfo(torch.float32).eps * projection.gram_norms.view(self.rows, self.group)
        values = self.values_at(idx).float()                                              # (rows, c, d)
        side_by_side = projection.grams_side_by_side(self.rows)
        if self.plan.accelerator:
            quadratic = quadratic_forms(values, side_by_side, self.plan.temporaries)
        else:
            quadratic = values.new_zeros(self.rows, self.group, values.shape[1])
            for r, size in enumerate(sizes):
                if size:
                    quadratic[r:r + 1, :, :size] = quadratic_forms(values[r:r + 1, :size], side_by_side[r:r + 1],
                                                                   self.plan.temporaries)
        room = rounding[..., None] * values.square().sum(-1)[:, None, :]
        upper = ((quadratic + room).clamp_min(0) * self.hidden).sqrt()
        attention = self.at(self.attention, idx)
        return (self.selection.combine(attention, upper) * self.slack,
                (quadratic - room).clamp_min(0).sqrt() if lower else None)

    def lower_bounds(self, idx: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """(rows, c) lower bounds of the scores of entries ``idx`` (rows, c): per query head the larger of
        ``norms`` (``gram_bounds``' ``||y||_2``) and ``sign_projections``' ``|v . u|`` (J d multiply-adds per
        entry and query head, less room for float32's rounding)."""
        u, u_room = self.sign_projections()
        values = self.values_at(idx).float()                                              # (rows, c, d)
        dots = torch.einsum("rcd,rgjd->rgjc", values, u).abs() - u_room[..., None] * values.norm(dim=-1)[:, None, None]
        norms = torch.maximum(norms, dots.amax(2).clamp_min(0))
        return self.selection.combine(self.at(self.attention, idx), norms) / self.slack

    def bounded(self, work: Stage2Work) -> torch.Tensor:
        """(rows, m) scores that keep what ``exhaustive`` keeps: exact for every entry that can reach its row's
        top ``k``, minus infinity elsewhere. Per row, with k entries to choose:

        0. Its best ``POOL x k`` entries (``ACCELERATOR_POOL x k`` on an accelerator) by the d bound (its pool) get
           the d^2 bound and (where the plan certifies, ``NormPlan.certifies``) a lower bound. An entry whose lower
           bound beats the row's k-th best upper bound is kept without its exact score: only the k - 1 entries
           above that could outscore it. One read for all rows: how many each has so (c; 0 without the round).
        1. The best of the rest of the pool by the upper bound (``first_candidates`` of k - c, rounded up to
           whole products) get their exact scores. With the c kept, their (k - c)-th best, the cut, is at most the
           row's true k-th best score, so an entry whose bound falls below it cannot reach the top k. One read
           for all rows: how many entries of the pool have a d^2 bound that reaches the cut, and how many outside
           it a d bound that does.
        2. The first are scored exactly; the second get the d^2 bound. One read: how many of them reach the cut.
        3. Those are scored exactly.
        Every entry tied with the k-th best is scored, so the stable tie rule picks as over all entries; under
        torch.topk's rule, whose order among ties depends on every entry, a row with a tie at the cut is scored
        exhaustively (a last read, when that rule applies and a row needed round 2).

        Rows ask for unequal numbers of entries: each step takes the largest for every row and masks the rest.
        Scores meant for no entry go to a last column, dropped at the end."""
        inf = float("-inf")
        counts, m = self.counts, self.m
        scores = torch.full((self.rows, m + 1), inf, device=self.device)
        live = [k > 0 for k in counts]
        if not any(live):
            return scores[:, :m]
        factor = ACCELERATOR_POOL if self.plan.accelerator else POOL
        pools = [min(m, max(factor * k, k + 256)) if k else 0 for k in counts]
        work.add_layer(sum(live), m)

        # Round 0: the d^2 bounds in each row's pool, the d bound elsewhere; the entries certified.
        spectral = self.spectral_bounds()                                                 # (rows, m)
        bound, pool = spectral.topk(max(pools), dim=-1)                                   # (rows, P)
        in_pool = self.below(pools, pool.shape[1]) & (bound > inf)
        upper, norms = self.gram_bounds(pool, pools, lower=self.plan.certifies)
        bound = torch.where(in_pool, torch.minimum(bound, upper), bound)
        work.gram += sum(pools)
        if self.plan.certifies:
            kth_upper = self.kth(spectral.scatter(1, pool, bound))                        # (rows, 1)
            certified = in_pool & (self.lower_bounds(pool, norms) > kth_upper)
            kept = self.read(work, certified.sum(-1))[0]
            work.certified += sum(kept)
            scores.scatter_(1, pool, torch.where(certified, float("inf"), inf))
            unsettled = in_pool & ~certified                                              # pool entries left
        else:
            unsettled, kept = in_pool, [0] * self.rows

        # Round 1: exact scores for the best of the rest of the pool by the upper bounds.
        sizes = [min(size - c, -(-first_candidates(k - c) // self.plan.tile) * self.plan.tile) if k else 0
                 for k, c, size in zip(counts, kept, pools)]
        if max(sizes):
            best, order = bound.masked_fill(~unsettled, inf).topk(max(sizes), dim=-1)
            candidates = pool.gather(1, order)
            self.score(candidates, self.below(sizes, order.shape[1]) & (best > inf), sizes, scores, work)
        view = scores[:, :m]
        cut = self.kth(view)                                                              # (rows, 1)
        open_ = ~self.excluded & (view == inf)                                            # not ruled out, not scored
        pooled = torch.zeros_like(open_).scatter_(1, pool, in_pool)
        to_score = torch.zeros_like(open_).scatter_(1, pool, (bound >= cut) & in_pool) & open_
        to_bound = (spectral >= cut) & open_ & ~pooled
        topk_rule = self.ws.conventions.ties == "topk"
        reads = self.read(work, to_score.sum(-1), to_bound.sum(-1), *([self.ties(view)] if topk_rule else []))
        tied = reads[2] if topk_rule else [0] * self.rows

        # Round 2, for the rows with no tie at the cut (rows with one are scored in full below).
        rows = [bool(k) and not t for k, t in zip(counts, tied)]
        n_score = [n if r else 0 for n, r in zip(reads[0], rows)]
        n_bound = [n if r else 0 for n, r in zip(reads[1], rows)]
        if max(n_score):
            self.score(self.marked(to_score, n_score), self.below(n_score, max(n_score)), n_score, scores, work)
        if max(n_bound):
            idx = self.marked(to_bound, n_bound)
            reach = self.below(n_bound, idx.shape[1]) & (self.gram_bounds(idx, n_bound)[0] >= cut)
            work.gram += sum(n_bound)
            # Round 3.
            n_reach = self.read(work, reach.sum(-1))[0]
            if max(n_reach):
                chosen = idx.gather(1, self.marked(reach, n_reach))
                self.score(chosen, self.below(n_reach, chosen.shape[1]), n_reach, scores, work)
        rescored = [r for r in range(self.rows) if n_score[r] or n_bound[r]]
        work.widened += len(rescored)
        full = [r for r in range(self.rows) if counts[r] and tied[r]]
        if topk_rule and rescored:    # the later rounds may have moved the cut onto a tie
            again = self.read(work, self.ties(scores[:, :m]))[0]
            full += [r for r in rescored if again[r]]
        if full:
            self.score_every_entry(full, scores, work)
        return scores[:, :m]

    def kth(self, scores: torch.Tensor) -> torch.Tensor:
        """(rows, 1) each row's k-th best score in ``scores`` (its best where k = 0)."""
        best = scores.topk(min(max(self.counts), self.m), dim=-1).values
        return best.gather(1, (self.k - 1).clamp_min(0)[:, None])

    def ties(self, scores: torch.Tensor) -> torch.Tensor:
        """(rows,) whether each row's k-th and (k+1)-th best scores in ``scores`` are equal (and finite)."""
        best = scores.topk(min(max(self.counts) + 1, self.m), dim=-1).values
        width = best.shape[1]
        kth = best.gather(1, (self.k - 1).clamp(0, width - 1)[:, None])[:, 0]
        after = best.gather(1, self.k.clamp(0, width - 1)[:, None])[:, 0]
        return (self.k > 0) & (self.k < width) & (after == kth) & (after > float("-inf"))

    @staticmethod
    def read(work: Stage2Work, *values: torch.Tensor) -> list:
        """The host's one wait for the device in a round: every count or flag at once."""
        work.host_reads += 1
        return torch.stack([x.long() for x in values]).tolist()

    @staticmethod
    def marked(mask: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """(rows, max(counts)) positions of each row's True entries of ``mask`` (rows, n), first the ``counts[r]``
        read before (no wait for the device), then whatever positions fill the row."""
        return mask.float().topk(max(counts), dim=-1).indices

    def score(self, idx: torch.Tensor, asked: torch.Tensor, sizes: list[int], scores: torch.Tensor,
              work: Stage2Work) -> None:
        """Exact scores of entries ``idx`` (rows, c) into ``scores``, where ``asked`` (rows, c)."""
        exact = self.exact(idx, sizes)
        scores.scatter_(1, torch.where(asked, idx, self.m), exact)
        scores[:, self.m] = float("-inf")
        work.exact += sum(sizes)

    def score_every_entry(self, rows: list[int], scores: torch.Tensor, work: Stage2Work) -> None:
        """Rows ``rows`` scored exactly over every entry (the exhaustive path's products, the same bits; a batch
        of rows that holds none of them computes nothing)."""
        every = self.exact(None, [self.m if r in rows else 0 for r in range(self.rows)])
        every = every.masked_fill(self.excluded, float("-inf"))
        for r in rows:
            scores[r, :self.m] = every[r]
        work.exact += self.m * len(rows)
