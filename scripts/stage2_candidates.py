"""How deep into its bounds' order stage 2 must score exactly, on the embedded model's real layers.

For every layer and KV head that perturbation selection compresses (SmolLM2, an essay prompt of ``--tokens``
tokens; SnapKV and AdaKV at budgets 128 and 1,024; the paper's and the released code's selection knobs), the
entries whose upper bound reaches the k-th best exact score are the ones any exact top-k by that bound must
score. Printed relative to k for stage 2's two bounds of ``||v W^O_h||_1``: ``sqrt(hidden lambda_max(G_h)) ||v||``
(d multiply-adds per entry) and ``sqrt(hidden v G_h v)`` (d^2), and the work the bounded stage 2 did (exact norms
and d^2 bounds per entry, heads with a second round). This sizes ``pcs.eviction.selection.POOL`` and
``first_candidates`` (results/bench/README.md).

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

BOUNDS = ("d bound", "d^2 bound")
records: list[tuple[int, list[int]]] = []    # per compressed head: k, and per bound the entries at or above the cut


def recording(bounded):
    """``Stage2.bounded``, first recording each head's depth under both bounds."""
    def wrapper(self, work):
        exact = self.exhaustive()
        every = torch.arange(self.m)
        gram = torch.stack([self.gram_bound(r, every) for r in range(self.rows)])
        bounds = (self.spectral_bounds(), gram.masked_fill(self.excluded, -float("inf")))
        for r, k in enumerate(self.counts):
            if k > 0:
                kth = exact[r].topk(k).values[-1]
                records.append((k, [int((bound[r] >= kth).sum()) for bound in bounds]))
        return bounded(self, work)
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
    print("| method | budget | selection | heads | " + " | ".join(f"{b}: depth/k median, p90, max" for b in BOUNDS)
          + " | exact norms / entries | d^2 bounds / entries | heads with a second round |")
    print("|---|---:|---|---:|" + "---|" * len(BOUNDS) + "---:|---:|---:|")
    for method in ("snapkv", "adakv"):
        for budget in (128, 1024):
            for knobs in ("perturbation", "perturbation_released"):
                records.clear()
                built = build_method(composed(method=method, selection=knobs, budget=budget))
                greedy_generate(model, ids, built, 1, set())
                work = built.selection.work
                cells = []
                for i in range(len(BOUNDS)):
                    r = sorted(depths[i] / k for k, depths in records)
                    cells.append(f"{statistics.median(r):.2f}, {r[int(0.9 * len(r))]:.2f}, {r[-1]:.2f}")
                print(f"| {method} | {budget} | {knobs} | {len(records)} | " + " | ".join(cells)
                      + f" | {100 * work.exact_share:.1f} % | {100 * work.gram_share:.1f} % "
                        f"| {work.widened} of {work.heads} |", flush=True)


if __name__ == "__main__":
    main()
