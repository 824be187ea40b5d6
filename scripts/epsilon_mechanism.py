"""What does stage 2's epsilon do to the kept entries? Measured on a run's own samples and prefill.

    python scripts/epsilon_mechanism.py RUN_DIR [--samples 10] [--epsilon 1e-4]

RUN_DIR: a perturbation-selection run of RULER's needle tasks (its model, benchmark, method, profile and budget are
used). Stage 2 scores an entry ``(A + epsilon) x N`` per query head, with ``A`` the window's attention on it and
``N = ||v W^O_h||_1`` its projected value norm. Where ``A`` is far below epsilon, that is epsilon times the value
norm: the ranking is by ``N`` alone. This script tests how far that goes. On the first ``--samples`` samples of
each task, one prefill on the full cache, and per layer:

- the share of (query head, prefix entry) pairs whose stage-2 attention is below epsilon (the reading with
  epsilon 0, un-pooled or pooled as the run's ``selection.stage2_source``);
- the kept entries of five selections of the run's budget: attention-only, the run's knobs with epsilon 0, with
  ``--epsilon``, with epsilon 1e6 (an entry's ``A`` adds at most 1e-6 of its score: the value-norm ranking) and,
  for an un-pooled run, with pooled attention;
- for each, its overlap with the value-norm ranking's kept entries (share of the kept prefix entries both keep, per
  (layer, KV head), averaged) and the share of the needle's value tokens it keeps;
- each selection's score on these samples, where its run folder exists beside RUN_DIR.

Nothing here is pcs's engine but its prefill (``pcs.output_perturbation.run_prefill``, the one a run does, which
``tests/test_perturbation.py`` holds to the engine's kept entries).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pcs.benchmarks.base import build_benchmark          # noqa: E402
from pcs.eviction import build_method                    # noqa: E402
from pcs.eviction.selection import PerturbationSelection  # noqa: E402
from pcs.identity import RunIdentity                     # noqa: E402
from pcs.models import load_model                        # noqa: E402
from pcs.needle_heads import value_positions             # noqa: E402
from pcs.output_perturbation import run_prefill          # noqa: E402
from pcs.run_folder import load_config, read_rows        # noqa: E402

NORM_RANKING = 1e6


def variant(cfg, **selection):
    out = OmegaConf.create(OmegaConf.to_container(cfg))
    with open_dict(out):
        if selection.pop("attention_only", False):
            out.selection = {"name": "attention"}
        else:
            out.selection.update(selection)
    return out


def results_root(run_dir: Path, cfg) -> Path:
    """The results folder RUN_DIR sits in (its config's folder, relative to it, is the run's identity)."""
    depth = len(Path(RunIdentity(cfg).folder).parts)
    return run_dir.resolve().parents[depth - 1]


def scores(folder: Path) -> dict | None:
    if not (folder / "predictions.jsonl").exists():
        return None
    return {row["id"]: row["score"] for row in read_rows(folder / "predictions.jsonl")}


def prefix_sets(kept, window: int, n: int) -> list[list[set]]:
    """Per compressed layer and KV head, the kept prefix positions (the window is kept by every selection)."""
    return [[set(h[h < n - window].tolist()) for h in layer] for layer in kept if layer is not None]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--samples", type=int, default=10, help="first samples of each task (default 10)")
    parser.add_argument("--epsilon", type=float, default=1e-4)
    args = parser.parse_args(argv)
    cfg = load_config(args.run_dir)
    if cfg.selection.name != "perturbation":
        parser.error(f"{args.run_dir} is not a perturbation-selection run")
    base = {k: cfg.selection[k] for k in ("alpha", "stage2_source", "gqa")}
    cfgs = {"attention-only": variant(cfg, attention_only=True),
            "epsilon 0": variant(cfg, **base, epsilon=0.0),
            f"epsilon {args.epsilon:g}": variant(cfg, **base, epsilon=args.epsilon),
            "value-norm ranking (epsilon 1e6)": variant(cfg, **base, epsilon=NORM_RANKING)}
    if base["stage2_source"] != "pooled":
        cfgs["epsilon 0, stage 2 pooled"] = variant(cfg, **{**base, "stage2_source": "pooled"}, epsilon=0.0)
    root = results_root(args.run_dir, cfg)
    run_scores = {name: scores(root / RunIdentity(c).folder) for name, c in cfgs.items()}
    methods = {name: build_method(c) for name, c in cfgs.items()}
    window = methods["epsilon 0"].window

    below: list[list[float]] = []          # per sample, per layer: share of stage-2 attention below epsilon
    reading = PerturbationSelection.stage2_attention

    def recorded(self, ws):
        attention = reading(self, ws)
        if self.epsilon == 0.0 and self.stage2_source == cfg.selection.stage2_source:
            below[-1].append(float((attention < args.epsilon).float().mean()))
        return attention

    PerturbationSelection.stage2_attention = recorded
    model, tokenizer = load_model(cfg.model)
    benchmark = build_benchmark(cfg)
    per_task: dict[str, int] = {}
    overlap = {name: [] for name in cfgs}
    needle = {name: [] for name in cfgs}
    answered = {name: [] for name in cfgs}
    for sample in benchmark.samples(tokenizer):
        task = sample.meta.get("task", "")
        if per_task.get(task, 0) >= args.samples:
            continue
        per_task[task] = per_task.get(task, 0) + 1
        prompt = benchmark.encode(sample, tokenizer, cfg.model)
        n = len(prompt.context)
        positions = set(value_positions(tokenizer, prompt.context, list(sample.meta["outputs"])))
        below.append([])
        prefill = run_prefill(model, torch.tensor([prompt.context]), methods)
        kept = {name: prefix_sets(prefill.kept[name], window, n) for name in cfgs}
        norm = kept["value-norm ranking (epsilon 1e6)"]
        for name in cfgs:
            pairs = [(a, b) for la, lb in zip(kept[name], norm) for a, b in zip(la, lb)]
            overlap[name].append(sum(len(a & b) / max(len(a), 1) for a, b in pairs) / len(pairs))
            heads = [a for layer in kept[name] for a in layer]
            needle[name].append(sum(len(a & positions) / len(positions) for a in heads) / len(heads))
            if (run_scores[name] or {}).get(sample.id) is not None:
                answered[name].append(run_scores[name][sample.id])
        print(f"[epsilon] {sample.id}: {n} tokens, needle {len(positions)} tokens, stage-2 attention below "
              f"{args.epsilon:g}: {100 * sum(below[-1]) / len(below[-1]):.1f} % of pairs", flush=True)

    layers = list(zip(*below))
    print(f"\n{len(below)} samples ({', '.join(f'{t} {k}' for t, k in per_task.items())}), {args.run_dir.name}")
    print(f"\nstage-2 attention ({cfg.selection.stage2_source}) below {args.epsilon:g}, share of (query head, prefix "
          f"entry) pairs: {100 * sum(map(sum, below)) / sum(map(len, below)):.1f} % over all layers; per layer "
          f"{', '.join(f'{100 * sum(v) / len(v):.0f}' for v in layers)}")
    print("\n| selection | kept prefix shared with the value-norm ranking | needle value kept | score (its run) |")
    print("|---|---:|---:|---:|")
    for name in cfgs:
        score = f"{sum(answered[name]) / len(answered[name]):.1f}" if answered[name] else "-"
        print(f"| {name} | {100 * sum(overlap[name]) / len(overlap[name]):.1f} % | "
              f"{100 * sum(needle[name]) / len(needle[name]):.1f} % | {score} |")
    print(json.dumps({"samples": len(below), "below_epsilon_per_layer": [sum(v) / len(v) for v in layers],
                      "overlap_with_norm_ranking": {k: sum(v) / len(v) for k, v in overlap.items()},
                      "needle_value_kept": {k: sum(v) / len(v) for k, v in needle.items()},
                      "score": {k: (sum(v) / len(v) if v else None) for k, v in answered.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
