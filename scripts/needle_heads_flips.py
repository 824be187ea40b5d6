"""The needle-heads analysis, paired: on the samples a baseline run answers right and another run loses, what each
kept of the needle's value and key in the retrieval heads and in every compressed head (same samples, so the
difference is the runs').

    python scripts/needle_heads_flips.py results/embedded/ruler/smollm2/needle_heads_b512.json \\
        --baseline snapkv_attention_b512 --runs snapkv_perturbation_b512 snapkv_perturbation_stage2_source=pooled_b512

A run is named ``<method>_<selection label>_b<budget>`` plus its method's changed knobs and conventions, from its
folder's config (the folders the analysis names, beside the analysis file).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pcs.identity import RunIdentity                                 # noqa: E402
from pcs.report.needle_heads import load, needle_kept, top_heads   # noqa: E402
from pcs.run_folder import load_config                               # noqa: E402


def name_of(run_dir: Path) -> str:
    run = RunIdentity(load_config(run_dir))
    return "_".join([run.cfg.method.name, run.selection_label, f"b{run.cfg.budget}", *run.method_knobs])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("analysis", type=Path)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--runs", nargs="+", required=True)
    args = parser.parse_args(argv)
    analysis = load(args.analysis)
    heads, n_q = top_heads(analysis), analysis["n_query_heads"]
    by_name = {name_of(args.analysis.parent / run): run for run in analysis["runs"]}
    base = by_name[args.baseline]
    print("| run | samples (baseline right, run lost) | value in retrieval heads: baseline / run | "
          "key in retrieval heads: baseline / run | value in every head: baseline / run |")
    print("|---|---:|---|---|---|")
    for name in args.runs:
        run = by_name[name]
        flips = [s for s in analysis["samples"] if s["full_score"] == 100 and s["runs"][base]["score"] == 100
                 and s["runs"][run]["score"] != 100]

        def mean(r, key, which):
            values = []
            for s in flips:
                kept = s["runs"][r][key]
                chosen = heads if which == "retrieval" else [(l, h) for l, x in enumerate(kept) if x is not None
                                                             for h in range(n_q)]
                values.append(needle_kept(kept, chosen, n_q))
            return f"{100 * np.mean(values):.0f} %" if values else "-"
        print(f"| {name} | {len(flips)} | {mean(base, 'kept', 'retrieval')} / {mean(run, 'kept', 'retrieval')} | "
              f"{mean(base, 'kept_key', 'retrieval')} / {mean(run, 'kept_key', 'retrieval')} | "
              f"{mean(base, 'kept', 'every')} / {mean(run, 'kept', 'every')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
