"""How deep into its bound order stage 2 must score exactly, on the embedded model's real layers.

For every layer and KV head that perturbation selection compresses (SmolLM2, an essay prompt of ``--tokens``
tokens; SnapKV and AdaKV at budgets 128 and 1,024; the paper's and the released code's selection knobs), the
entries whose upper bound reaches the k-th best exact score are the ones any exact top-k by bound must score.
Printed relative to k, for three bounds of ``||v W^O_h||_1``: the column bound ``sum_j |v_j| ||W^O_h[j, :]||_1``
(d multiply-adds), ``sqrt(hidden) ||v W^O_h||_2`` from the Gram matrix (d^2; the one pcs uses) and their minimum.
This sizes ``pcs.eviction.selection.WIDENINGS`` (results/bench/README.md).

    .venv/bin/python scripts/stage2_candidates.py [--tokens 4096]
"""
import argparse
import statistics

import torch
from transformers import AutoTokenizer

from pcs.bench import build_model, composed
from pcs.benchmarks.needle import essay_files
from pcs.eviction import build_method
from pcs.eviction import selection
from pcs.generate import greedy_generate
from pcs.models import weights_location

BOUNDS = ("column", "gram", "min")
records: list[tuple[int, list[int]]] = []    # per compressed head: k, and per bound the entries at or above the cut


def recording(bounded):
    """``Stage2.bounded``, first recording each head's depth under the three bounds."""
    def wrapper(self, counts, work):
        for g, k in enumerate(counts):
            if k <= 0:
                continue
            weights = self.weights[self.heads(g)].float()                     # (group, d, hidden)
            values = self.ws.prefix_values[g].float()
            attention = self.attention[self.heads(g)]
            kth = self.exact(g).masked_fill(self.excluded[g], -float("inf")).topk(k).values[-1]
            column = weights.abs().sum(-1) @ values.abs().T
            gram = weights @ weights.transpose(1, 2)
            l2 = torch.einsum("md,gde,me->gm", values, gram, values).clamp_min(0).sqrt() * weights.shape[-1] ** 0.5
            depths = []
            for norms in (column, l2, torch.minimum(column, l2)):
                bound = self.selection.combine(attention, norms).masked_fill(self.excluded[g], -float("inf"))
                depths.append(int((bound >= kth).sum()))
            records.append((k, depths))
        return bounded(self, counts, work)
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    selection.Stage2.bounded = recording(selection.Stage2.bounded)
    model = build_model("smollm2", 0, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(weights_location(composed(model="smollm2").model))
    text = " ".join(path.read_text() for path in essay_files(None))
    ids = torch.tensor([tokenizer(text)["input_ids"][:args.tokens]])
    print("| method | budget | selection | heads | " + " | ".join(f"{b}: depth/k median, p90, max, heads > 2k"
                                                           for b in BOUNDS) + " |")
    print("|---|---:|---|---:|" + "---|" * len(BOUNDS))
    for method in ("snapkv", "adakv"):
        for budget in (128, 1024):
            for knobs in ("perturbation", "perturbation_released"):
                records.clear()
                greedy_generate(model, ids, build_method(composed(method=method, selection=knobs, budget=budget)), 1,
                                set())
                cells = []
                for i in range(len(BOUNDS)):
                    r = sorted(depths[i] / k for k, depths in records)
                    cells.append(f"{statistics.median(r):.2f}, {r[int(0.9 * len(r))]:.2f}, {r[-1]:.2f}, "
                                 f"{sum(x > 2 for x in r)}")
                print(f"| {method} | {budget} | {knobs} | {len(records)} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
