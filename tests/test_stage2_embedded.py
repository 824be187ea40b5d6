"""The bounded stage 2 on a real model's layers: the embedded SmolLM2 on prompts made of repeats, on which some
heads' stage-2 scores tie at the cut. tests/test_selection.py holds the bounded search to the exhaustive one on
random layers, whose scores never tie."""

import pytest
import torch

from pcs.eviction import build_method
from pcs.eviction.selection import PerturbationSelection
from pcs.generate import greedy_generate
from pcs.models import load_model
from conftest import compose_cfg

pytestmark = pytest.mark.slow

# (overrides, budget, whether stage-2 scores tie at the cut in some head): each profile's tie rule, both selections'
# knobs, the three allocations. Where the ties fall was observed, not derived: in one to four of a cell's 90 layer
# selections (layers 4 to 28 of the one-token prompt), none under criticalkv's knobs (average pooling).
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

    def both(self, budgets, ws, exhaustive=False, tail=0):
        bounded = select(self, budgets, ws, False, tail)
        reference = select(self, budgets, ws, True, tail)
        assert [b.tolist() for b in bounded] == [r.tolist() for r in reference], (overrides, layers[0])
        layers[0] += 1
        tied[0] += ties_at_the_cut(self, budgets, ws)
        return reference
    monkeypatch.setattr(PerturbationSelection, "select", both)
    for name, ids in prompts(tokenizer).items():
        method = build_method(compose_cfg(*overrides, f"budget={budget}"))
        with torch.inference_mode():
            greedy_generate(model, torch.tensor([ids]), method, 1, set())
    assert layers[0] == 3 * model.config.num_hidden_layers
    if ties:    # the prompts did what they are for: some heads' k-th and (k+1)-th best stage-2 scores were equal
        assert tied[0] > 0


def ties_at_the_cut(selection, budgets, ws) -> int:
    """Heads whose k-th and (k+1)-th best exhaustive stage-2 scores are equal (and finite)."""
    _, stage2 = selection.stages([min(b, ws.stage1.shape[1]) for b in budgets], ws)
    return int(stage2.ties(stage2.exhaustive()).sum())
