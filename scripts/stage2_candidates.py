"""How deep into its bounds' order stage 2 must score exactly, on the embedded model's real layers.

For every layer and KV head that perturbation selection compresses (SmolLM2, an essay prompt of ``--tokens``
tokens; SnapKV and AdaKV at budgets 128 and 1,024; the paper's and the released code's selection knobs), the
entries whose upper bound reaches the k-th best exact score are the ones any exact top-k by that bound must
score. Printed relative to k for stage 2's two bounds of ``||v W^O_h||_1``: ``sqrt(hidden lambda_max(G_h)) ||v||``
(d multiply-adds per entry) and ``sqrt(hidden v G_h v)`` (d^2), and the work the bounded stage 2 did (exact norms
and d^2 bounds per entry, heads with a second round). This sizes ``pcs.eviction.selection.POOL`` and
``first_candidates`` (results/bench/README.md).

The band: the entries of the top k whose lower bound does not beat the (k+1)-th best exact score, and the
entries outside it whose upper bound reaches the k-th. Even knowing every other entry's exact score, an exact
top-k that knows only these bounds of an entry of the band cannot tell whether it is in, so the band's share of
the entries is the floor of the exact norms' share under those bounds. Printed for stage 2's bounds (upper: the
smaller of the two above; lower: ``Stage2.lower_bounds``) and, to say which side limits it, with the lower bound
replaced by the exact score (the band is then the entries outside the top k whose upper bound reaches it).

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
# per compressed head: k, per bound the entries at or above the cut, the band, the band with an exact lower bound
records: list[tuple[int, list[int], int, int]] = []


def recording(bounded):
    """``Stage2.bounded``, first recording each head's depth under both bounds."""
    def wrapper(self, work):
        exact = self.exhaustive()
        every = torch.arange(self.m).expand(self.rows, self.m)
        gram, norms = self.gram_bounds(every, [self.m] * self.rows, lower=True)
        gram = gram.masked_fill(self.excluded, -float("inf"))
        lowers = self.lower_bounds(every, norms)
        spectral = self.spectral_bounds()
        upper = torch.minimum(spectral, gram)
        for r, k in enumerate(self.counts):
            if k > 0:
                best = exact[r].topk(min(k + 1, self.m)).values
                kth, next_ = best[k - 1], best[-1] if k < self.m else -float("inf")
                top = exact[r].topk(k).indices
                inside = torch.zeros(self.m, dtype=torch.bool).index_fill_(0, top, True)
                outside = ~inside & ~self.excluded[r]
                lower = lowers[r]
                reaching = int((outside & (upper[r] >= kth)).sum())
                band = int((inside & (lower <= next_)).sum()) + reaching
                records.append((k, [int((bound[r] >= kth).sum()) for bound in (spectral, gram)], band, reaching))
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
          + " | band / entries | band with an exact lower bound / entries | exact norms / entries "
            "| d^2 bounds / entries | heads with a second round |")
    print("|---|---:|---|---:|" + "---|" * len(BOUNDS) + "---:|---:|---:|---:|---:|")
    for method in ("snapkv", "adakv"):
        for budget in (128, 1024):
            for knobs in ("perturbation", "perturbation_released"):
                records.clear()
                built = build_method(composed(method=method, selection=knobs, budget=budget))
                greedy_generate(model, ids, built, 1, set())
                work = built.selection.work
                cells = []
                for i in range(len(BOUNDS)):
                    r = sorted(depths[i] / k for k, depths, *_ in records)
                    cells.append(f"{statistics.median(r):.2f}, {r[int(0.9 * len(r))]:.2f}, {r[-1]:.2f}")
                # shares of every prefix entry of the heads, as the bounded stage 2's work columns count them
                entries = work.entries
                band, band_exact_lower = (100 * sum(rec[i] for rec in records) / entries for i in (2, 3))
                print(f"| {method} | {budget} | {knobs} | {len(records)} | " + " | ".join(cells)
                      + f" | {band:.1f} % | {band_exact_lower:.1f} % | {100 * work.exact_share:.1f} % | {100 * work.gram_share:.1f} % "
                        f"| {work.widened} of {work.heads} |", flush=True)


if __name__ == "__main__":
    main()
