"""Algorithm 1 of "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective", for one
layer, in plain tensor operations: the definition that ``selection.PerturbationSelection`` and its fast paths
(``stage2_search``'s bounded search, the tiled norms, the norms kernel) are tested equal to
(``tests/test_algorithm1.py``, ties included). Nothing here bounds, tiles or batches.

A layer's prefix is its first m entries, before the observation window of w entries that every head keeps. A KV
head (one row) with prefix budget B (its budget b less the window) keeps:

    stage 1   the top  B' = floor(alpha x B)  prefix entries by the window's pooled attention, averaged over the
              KV head's query heads                                                   (the paper's b' = b x alpha)
    stage 2   of the entries stage 1 left, the top  B - B'  by  mean_h (A_h,i + epsilon) x ||v_i W^O_h||_1,
              h over the KV head's query heads: A_h,i the window's mean attention of query head h on entry i
              (un-pooled, Algorithm 2 line 9), ||v_i W^O_h||_1 the L1 norm of the entry's value through h's slice
              of the output projection, which bounds how far the entry moves h's output (Theorem 1)

Ties go to the earlier entry. ``stage1_rule="budget"`` sizes stage 1 as ``int(alpha x b) - w`` (the released
code, window counted first); ``gqa="product_of_means"`` multiplies the group's mean attention by its mean norm
(the released code); ``protected`` entries (AdaKV's safeguard) are kept in stage 1 whatever alpha.
"""
from __future__ import annotations

import torch


def value_output_l1(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """(H_q, m) ``||v_i W^O_h||_1`` for every query head h and entry i: ``values`` (rows, m, d), one row per KV head
    (or per query head, each holding its KV head's values), ``o_proj_weight`` (hidden, H_q x d)."""
    rows, m, d = values.shape
    n_query_heads = o_proj_weight.shape[1] // d
    group = n_query_heads // rows
    norms = []
    for h in range(n_query_heads):
        w_h = o_proj_weight.detach()[:, h * d:(h + 1) * d].float()         # W^O_h, (hidden, d)
        outputs = values[h // group].float() @ w_h.T                        # v_i W^O_h, (m, hidden)
        norms.append(outputs.abs().sum(dim=-1))
    return torch.stack(norms)


def stage1_size(alpha: float, prefix_budget: int, window: int = 0, rule: str = "prefix") -> int:
    """B' of a head with ``prefix_budget`` B: ``floor(alpha x B)``, or under ``rule="budget"``
    ``int(alpha x (B + w)) - w`` (at least 0)."""
    if rule == "budget":
        return max(0, int(alpha * (prefix_budget + window)) - window)
    return int(alpha * prefix_budget)


def top(scores: torch.Tensor, k: int) -> list[int]:
    """Positions of the ``k`` highest of 1-D ``scores``, ties to the earlier entry."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return order[:max(k, 0)]


def stage2_scores(attention: torch.Tensor, values: torch.Tensor, o_proj_weight: torch.Tensor,
                  gqa: str = "mean_of_products", epsilon: float = 0.0) -> torch.Tensor:
    """(rows, m) stage 2's score of every prefix entry: ``attention`` (H_q, m) the window's mean attention (or
    (rows, m): one score standing for each row's query heads), ``values`` (rows, m, d)."""
    rows, m, _ = values.shape
    norms = value_output_l1(values, o_proj_weight).view(rows, -1, m)        # (rows, group, m)
    weights = (attention.float() + epsilon).view(rows, -1, m)
    if gqa == "mean_of_products":
        return (weights * norms).mean(dim=1)
    return weights.mean(dim=1) * norms.mean(dim=1)


def stage1(stage1_scores: torch.Tensor, budgets: list[int], alpha: float, window: int = 0, rule: str = "prefix",
           protected: int = 0) -> list[list[int]]:
    """Each row's stage-1 picks: its top ``stage1_size`` (at least ``protected``) prefix entries by ``stage1_scores``
    (rows, m), the pooled attention (its group mean)."""
    m = stage1_scores.shape[1]
    sizes = [min(m, max(stage1_size(alpha, min(b, m), window, rule), min(protected, b))) for b in budgets]
    return [top(row, size) for row, size in zip(stage1_scores, sizes)]


def select(stage1_scores: torch.Tensor, attention: torch.Tensor, values: torch.Tensor, o_proj_weight: torch.Tensor,
           budgets: list[int], alpha: float, window: int = 0, stage1_rule: str = "prefix",
           gqa: str = "mean_of_products", epsilon: float = 0.0, protected: int = 0) -> list[list[int]]:
    """Each row's kept prefix positions, ascending: ``stage1``'s picks, then the row's top ``B - B'`` of the entries
    left by ``stage2_scores`` (``attention`` and ``values`` as it takes them), ``budgets[r]`` row r's prefix budget
    B."""
    m = stage1_scores.shape[1]
    scores = stage2_scores(attention, values, o_proj_weight, gqa, epsilon)
    kept = []
    for r, first in enumerate(stage1(stage1_scores, budgets, alpha, window, stage1_rule, protected)):
        left = scores[r].clone()
        left[first] = float("-inf")
        kept.append(sorted(first + top(left, min(budgets[r], m) - len(first))))
    return kept
