"""The bounded stage 2 on a real model's layers: the embedded SmolLM2 on prompts made of repeats, each layer's
selection made once as the model gives it and once with a tie built at every head's cut (its (k+1)-th best entry
made a copy of its k-th: the same value, the same attention, so the same score bit for bit, an entry's score not
depending on the entries scored with it). tests/test_selection.py holds the bounded search to the exhaustive one
on random layers."""
import dataclasses

import pytest
import torch

from pcs.eviction import build_method
from pcs.eviction.selection import PerturbationSelection
from pcs.generate import greedy_generate
from pcs.models import load_model
from conftest import compose_cfg

pytestmark = pytest.mark.embedded

# (overrides, budget, whether ties are built at the cut): each profile's tie rule, both selections' knobs, the three
# allocations; criticalkv's knobs as the model gives them only.
CELLS = [
    (("method=snapkv", "selection=perturbation_released", "profile=paper"), 64, True),
    (("method=snapkv", "selection=perturbation_released", "profile=kvpress"), 96, True),
    (("method=pyramidkv", "selection=perturbation_released", "profile=kvcache_factory"), 64, True),
    (("method=adakv", "selection=perturbation", "profile=adakv"), 96, True),
    (("preset=criticalkv", "method=adakv"), 128, False),
]


@pytest.fixture(scope="module")
def smollm2(embedded_dir):
    model, tokenizer = load_model(compose_cfg("model.device=cpu").model)
    return model, tokenizer


def prompts(tokenizer, n=384):
    the, stop = tokenizer(" the")["input_ids"][0], tokenizer(".")["input_ids"][0]
    pattern = tokenizer(" one two three")["input_ids"]
    sentence = tokenizer(" The needle is in the haystack, and the haystack is long.")["input_ids"]
    return {"one token": [the] * n,
            "a pattern": (pattern * n)[:n],
            "a sentence, then one token": (sentence * n)[:n // 2] + [stop] * (n - n // 2)}


@pytest.mark.parametrize("overrides,budget,ties", CELLS, ids=[" ".join(o) for o, *_ in CELLS])
def test_bounded_stage2_keeps_what_exhaustive_scoring_keeps_on_repeats(smollm2, overrides, budget, ties, monkeypatch):
    model, tokenizer = smollm2
    select = PerturbationSelection.select
    layers, tied = [0], [0]

    def both(self, budgets, ws, exhaustive=False, tail=0, stage2=None):
        for case in ([ws, tied_at_each_cut(self, budgets, ws)] if ties else [ws]):
            bounded = select(self, budgets, case, False, tail, stage2)
            reference = select(self, budgets, case, True, tail)
            assert [b.tolist() for b in bounded] == [r.tolist() for r in reference], (overrides, layers[0])
        layers[0] += 1
        tied[0] += ties_at_the_cut(self, budgets, case)
        return reference
    monkeypatch.setattr(PerturbationSelection, "select", both)
    for name, ids in prompts(tokenizer).items():
        method = build_method(compose_cfg(*overrides, f"budget={budget}"))
        with torch.inference_mode():
            greedy_generate(model, torch.tensor([ids]), method, 1, set())
    assert layers[0] == 3 * model.config.num_hidden_layers
    if ties:    # the built ties are ties: some heads' k-th and (k+1)-th best stage-2 scores were equal
        assert tied[0] > 0


def ties_at_the_cut(selection, budgets, ws) -> int:
    """Heads whose k-th and (k+1)-th best exhaustive stage-2 scores are equal (and finite)."""
    _, stage2 = selection.stages([min(b, ws.stage1.shape[1]) for b in budgets], ws)
    return int(stage2.ties(stage2.exhaustive()).sum())


def tied_at_each_cut(selection, budgets, ws):
    """``ws`` with, in every head that chooses in stage 2, its (k+1)-th best entry by exhaustive scoring replaced by
    a copy of its k-th best (value vector, and each query head's attention, un-pooled and pooled): the two score
    the same bits, and every other entry keeps its score."""
    _, stage2 = selection.stages([min(b, ws.stage1.shape[1]) for b in budgets], ws)
    scores = stage2.exhaustive()
    order = scores.argsort(dim=-1, descending=True, stable=True)
    values, mean, pooled = ws.prefix_values.clone(), ws.mean_attention.clone(), ws.pooled_attention.clone()
    group = mean.shape[0] // values.shape[0]
    for row, k in enumerate(stage2.counts):
        if 0 < k < int((scores[row] > float("-inf")).sum()):
            kth, after = order[row, k - 1], order[row, k]
            values[row, after] = values[row, kth]
            heads = slice(row * group, (row + 1) * group)
            mean[heads, after], pooled[heads, after] = mean[heads, kth], pooled[heads, kth]
    return dataclasses.replace(ws, prefix_values=values, mean_attention=mean, pooled_attention=pooled)
