"""The definition of Algorithm 1 (``pcs.eviction.algorithm1``) against loops over the paper's equations, and every
fast path of perturbation selection (stage 2 scored exhaustively with the tiled norms, the bounded search, the
norms kernel under Triton's interpreter) against the definition: on random layers whose cut falls inside a tie of
bitwise-equal entries, and on every layer of the embedded SmolLM2."""
import dataclasses
import math
import os

import pytest
import torch

from pcs.eviction import algorithm1, build_method
from pcs.eviction.base import LayerState
from pcs.eviction.stage2_search import Stage2Run
from pcs.options import defaults

from conftest import compose_cfg, embedded_essay_layers


def loop_norms(values, o_proj_weight):
    """(H_q, m) ``||v_i W^O_h||_1`` entry by entry and query head by query head, in float64."""
    rows, m, d = values.shape
    heads = o_proj_weight.shape[1] // d
    out = torch.zeros(heads, m, dtype=torch.float64)
    for h in range(heads):
        for i in range(m):
            y = o_proj_weight[:, h * d:(h + 1) * d].double() @ values[h // (heads // rows), i].double()
            out[h, i] = sum(abs(float(x)) for x in y)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gqa", ["mean_of_products", "product_of_means"])
def test_the_definition_is_the_papers_two_stages_by_loops(seed, gqa):
    """Stage 1 the top floor(alpha B) by the pooled scores, stage 2 the top B - B' of the rest by the group's
    attention-weighted norms, each entry's norm summed by hand: the same entries as the definition."""
    g = torch.Generator().manual_seed(seed)
    rows, group, m, d, hidden, alpha = 2, 3, 40, 4, 10, 0.25
    values, weight = torch.randn(rows, m, d, generator=g), torch.randn(hidden, rows * group * d, generator=g)
    attention, stage1 = torch.rand(rows * group, m, generator=g), torch.rand(rows, m, generator=g)
    budgets = [17, 9]
    norms = loop_norms(values, weight)
    assert torch.allclose(algorithm1.value_output_l1(values, weight).double(), norms, rtol=1e-5)
    kept = algorithm1.select(stage1, attention, values, weight, budgets, alpha, gqa=gqa)
    for r, budget in enumerate(budgets):
        heads = range(r * group, (r + 1) * group)
        first = sorted(range(m), key=lambda i: -float(stage1[r, i]))[:math.floor(alpha * budget)]
        if gqa == "mean_of_products":
            score = [sum(float(attention[h, i]) * float(norms[h, i]) for h in heads) / group for i in range(m)]
        else:
            score = [sum(float(attention[h, i]) for h in heads) / group * sum(float(norms[h, i]) for h in heads)
                     / group for i in range(m)]
        second = [i for i in sorted(range(m), key=lambda i: -score[i]) if i not in first][:budget - len(first)]
        assert kept[r] == sorted(first + second)


def test_stage1_sizes_follow_the_paper_and_the_released_code():
    assert algorithm1.stage1_size(0.25, 95) == 23                        # floor(alpha x B)
    assert algorithm1.stage1_size(0.5, 96, window=32, rule="budget") == 32   # int(alpha x b) - w
    assert algorithm1.stage1_size(0.2, 10, window=32, rule="budget") == 0


def definition_of(method, layer):
    """What the definition keeps in ``layer`` for ``method`` (a window method with perturbation selection): each row's
    prefix positions, then the window; with stage 2's scores and stage 1's picks."""
    ws, budgets = method.plan(layer)
    sel = method.selection
    attention = ws.mean_attention if sel.stage2_source == "unpooled" else ws.pooled_attention
    args = dict(gqa=sel.gqa, epsilon=sel.epsilon)
    kept = algorithm1.select(ws.stage1, attention, ws.prefix_values, ws.o_proj_weight, budgets, sel.alpha,
                             window=ws.window, stage1_rule=ws.conventions.stage1, protected=ws.protected, **args)
    first = algorithm1.stage1(ws.stage1, budgets, sel.alpha, ws.window, ws.conventions.stage1, ws.protected)
    m = ws.stage1.shape[1]
    scores = algorithm1.stage2_scores(attention, ws.prefix_values, ws.o_proj_weight, **args)
    return [k + list(range(m, m + ws.window)) for k in kept], scores, first


def assert_keeps_the_definitions_entries(fast, method, layer) -> None:
    """Row for row the entries the definition keeps, but where two entries' scores come within float32 rounding of
    each other at the cut (their norms are summed in another order); entries whose scores are equal to the bit go
    as the definition breaks the tie."""
    want, scores, _ = definition_of(method, layer)
    for row, (got, kept) in enumerate(zip(fast, want)):
        got = got.tolist()
        if got == kept:
            continue
        m = scores.shape[1]
        cut = min(float(scores[row, i]) for i in kept if i < m and scores[row, i] > float("-inf"))
        dropped, added = set(kept) - set(got), set(got) - set(kept)
        for i in dropped | added:
            assert math.isclose(float(scores[row, i]), cut, rel_tol=1e-5), (row, i, float(scores[row, i]), cut)
        assert not {float(scores[row, i]) for i in dropped} & {float(scores[row, j]) for j in added}, \
            (row, "a tie broken otherwise than the definition breaks it", sorted(dropped), sorted(added))


METHODS = [(m, s) for m in ("snapkv", "pyramidkv", "adakv") for s in ("perturbation", "perturbation_released")]


def methods(budget: int, window: int):
    return [build_method(compose_cfg(f"method={m}", f"selection={s}", f"budget={budget}", f"method.window={window}",
                                     "method.kernel=5", "method.pooling=avg")) for m, s in METHODS]


def random_layer(seed: int, n: int = 700) -> LayerState:
    g = torch.Generator().manual_seed(seed)
    h_kv, h_q, d, hidden = 2, 6, 16, 48
    keys, values = torch.randn(h_kv, n, d, generator=g), torch.randn(h_kv, n, d, generator=g)
    return LayerState(3, 8, keys, values, torch.randn(h_q, 64, d, generator=g) * 2,
                      torch.randn(hidden, h_q * d, generator=g))


def bounded() -> Stage2Run:
    """Stage 2 by the bounded search, whatever the device's plan (the kernel's case plans an accelerator's)."""
    return Stage2Run(dataclasses.replace(defaults().stage2, search="bounded"))


def stage2_ranking(method, layer, row: int) -> tuple[list[int], int]:
    """Row ``row``'s prefix entries that stage 1 left, best first by the definition's stage 2, and how many of them
    stage 2 keeps."""
    want, scores, first = definition_of(method, layer)
    m = scores.shape[1]
    left = [i for i in algorithm1.top(scores[row], m) if i not in first[row]]
    return left, len([i for i in want[row] if i < m]) - len(first[row])


def tied_layer(seed: int, method, copies: int = 4) -> LayerState:
    """A random layer in which ``copies`` bitwise copies (keys and values, both KV heads) of one entry and its
    neighbours within the pooling kernel are spread over the prefix, so that row 0's stage 2 cuts among the copied
    entries (which score alike to the bit, pooled or not): of the entries its stage 2 ranks near its cut in the
    layer without copies, the first whose copies straddle the cut."""
    ranking, count = stage2_ranking(method, random_layer(seed), 0)
    half = method.kernel // 2
    for source in ranking[max(0, count - 60):count + 20]:
        layer = random_layer(seed)
        if not half <= source < layer.n_tokens - method.window - half:
            continue
        block = slice(source - half, source + half + 1)
        places = [p for p in range(8, layer.n_tokens - method.window - half, 97) if abs(p - source) > 2 * half + 1]
        for p in places[:copies]:
            layer.keys[:, p - half:p + half + 1] = layer.keys[:, block].clone()
            layer.values[:, p - half:p + half + 1] = layer.values[:, block].clone()
        if cut_inside_a_tie(method, layer):
            return layer
    raise AssertionError("no entry's copies straddle the cut: the layer would test no tie")


def cut_inside_a_tie(method, layer) -> bool:
    """Whether some row's stage 2 keeps part of a group of entries with bitwise-equal scores, not all of it."""
    _, scores, _ = definition_of(method, layer)
    for row in range(layer.keys.shape[0]):
        ranking, count = stage2_ranking(method, layer, row)
        if count and float(scores[row, ranking[count - 1]]) == float(scores[row, ranking[count]]):
            return True
    return False


@pytest.fixture(params=["scored", "bounded", "norms kernel"])
def fast_path(request, monkeypatch):
    """Stage 2 scoring every entry with the tiled norms, the bounded search, or the bounded search with the norms
    kernel (Triton's interpreter on this CPU: ``TRITON_INTERPRET=1`` set before torch imports Triton, which
    ``make test`` does where Triton is installed)."""
    if request.param == "norms kernel":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1, set before the run)")
        import pcs.eviction.scores as scores_module
        from pcs.kernels import value_norms as kernel
        monkeypatch.setattr(scores_module, "batches_rows", lambda device: True)
        monkeypatch.setattr(kernel, "available", lambda device, d: True)
        kernel._kernel.cache_clear()
        request.addfinalizer(kernel._kernel.cache_clear)
    return request.param


def fast_keep(method, layer, path: str):
    """``method.keep(layer)`` by the fast path named (``scored``: stage 2's tiled norms for every entry)."""
    if path == "scored":
        ws, budgets = method.plan(layer)
        return method.selection.select(budgets, ws, exhaustive=True, tail=method.window)
    return method.keep(layer, bounded())


@pytest.mark.parametrize("seed", range(2))
def test_every_fast_path_keeps_the_definitions_entries_through_a_tie(seed, fast_path):
    budget, window = 200, 16
    for method in methods(budget, window):
        layer = tied_layer(seed, method)
        assert_keeps_the_definitions_entries(fast_keep(method, layer, fast_path), method, layer)


def test_every_real_layer_keeps_the_definitions_entries(embedded_dir):
    """Every layer of the embedded SmolLM2 on 600 tokens of essays, at a tight and a loose budget."""
    _, _, states = embedded_essay_layers(embedded_dir)
    for budget in (96, 320):
        for method in methods(budget, 32):
            for layer in states:
                assert_keeps_the_definitions_entries(method.keep(layer, bounded()), method, layer)
