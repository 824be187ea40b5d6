"""Budget allocation against the published formulas, written out independently here."""
import torch

from pcs.eviction.adakv import adaptive_budgets, largest_remainder
from pcs.eviction.pyramidkv import pyramid_layer_budget
from pcs.eviction.snapkv import uniform_budgets


def test_uniform_every_head_gets_budget_minus_window():
    assert uniform_budgets(3, 128, 32, 1000).tolist() == [96, 96, 96]


def test_pyramid_matches_kvcache_factory_formula_and_averages_to_budget():
    for budget, window, layers in [(128, 32, 32), (64, 32, 30), (512, 32, 32), (1024, 32, 64)]:
        b = budget - window
        low, high = b // 20, 2 * b - b // 20
        step = (high - low) // (layers - 1)
        expected = [high - l * step for l in range(layers)]
        got = [pyramid_layer_budget(l, layers, budget, window, 10**6) for l in range(layers)]
        assert got == expected
        assert got == sorted(got, reverse=True)
        mean_total = window + sum(got) / layers
        # Integer steps put the mean at most (L - 1) / 2 entries above the budget.
        assert budget <= mean_total <= budget + (layers - 1) / 2


def test_pyramid_clips_to_the_prompt_keeping_the_sum():
    got = [pyramid_layer_budget(l, 2, 128, 32, 150) for l in range(2)]
    assert got[0] == 150 and sum(got) == 2 * 96


def test_adaptive_total_floor_and_brute_force_counts():
    torch.manual_seed(0)
    for _ in range(20):
        scores = torch.rand(4, 200) ** 4
        scores[0] *= 10          # one head dominates the layer-wide top-k
        budget, window, floor = 64, 16, 0.2
        b = budget - window
        got = adaptive_budgets(scores, budget, window, floor)
        assert int(got.sum()) == 4 * b
        assert int(got.min()) >= int(floor * b)
        # Brute force: rank all (head, token) pairs, count the winners per head.
        pairs = sorted(((float(scores[h, i]), h) for h in range(4) for i in range(200)), reverse=True)
        counts = [0] * 4
        for _, h in pairs[: 4 * b]:
            counts[h] += 1
        ideal = [(1 - floor) * c + floor * b for c in counts]
        assert all(abs(int(g) - x) < 1 for g, x in zip(got, ideal))
        assert got[0] > b   # the dominant head really gets more than the uniform share


def test_largest_remainder_rounds_to_the_total():
    shares = torch.tensor([1.5, 1.5, 1.0], dtype=torch.float64)
    assert largest_remainder(shares, 4).tolist() == [2, 1, 1]


def hamilton(shares: list[float], total: int) -> list[int]:
    """Hamilton's method written out: floors, then one more for the largest remainders, the earlier head first among
    equal ones, until the total is reached."""
    base = [int(x // 1) for x in shares]
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - base[i]), i))
    for i in order[:max(0, total - sum(base))]:
        base[i] += 1
    return base


def test_largest_remainder_is_hamiltons_method_ties_included():
    """Against the method written out, on shares whose remainders tie often (quarters), from totals the floors miss
    by 0 to n - 1."""
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        total = int(torch.randint(0, 400, (1,), generator=g))
        quarters = torch.randint(0, 4, (n,), generator=g).double() / 4
        weights = torch.rand(n, generator=g, dtype=torch.float64) if trial % 2 else torch.ones(n, dtype=torch.float64)
        shares = (weights / weights.sum() * total).floor() + quarters     # remainders 0, 1/4, 1/2, 3/4: ties
        assert largest_remainder(shares, total).tolist() == hamilton(shares.tolist(), total), shares
