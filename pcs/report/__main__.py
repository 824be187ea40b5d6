"""The paper's tables, the significance of every selection difference, budget savings with intervals, needle
heatmaps, RULER and ablation figures and perturbation-analysis figures, from a results folder or a tidy CSV.

    python -m pcs.report --results PATH --out DIR [--paper] [--resamples N --seed S]
    python -m pcs.report --results PATH --leaderboard EXPERIMENT [...] [--bench JSONL ...] --out DIR

PATH is a folder of run folders (any depth) or a CSV with columns model, method, selection, budget,
score (and optionally domain, table), such as the paper's own numbers, shipped as
``pcs/data/paper_longbench_tables.csv``. ``--paper`` puts the paper's value and the difference
beside each measured cell. Everything lands in DIR, indexed by ``DIR/report.md``.

``--leaderboard`` writes only a leaderboard of the runs of those experiments' sweeps under PATH (finished or not,
on the samples all have answered): per model and length, each run's score with its interval, the entries it
kept, its prefill and decode time relative to the full cache (from ``--bench`` files of ``python -m pcs.bench
--json``), and the paired effect of perturbation selection; in ``DIR/README.md``, with a figure per table.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import RESAMPLES, SEED
from ..cli import command


def main(argv: list[str] | None = None) -> int:
    parser = command("pcs.report", __doc__)
    parser.add_argument("--results", type=Path, required=True, help="results folder or tidy CSV")
    parser.add_argument("--out", type=Path, required=True, help="the folder the report is written to (report.md, "
                        "tables/, figures, significance.csv, savings.csv)")
    parser.add_argument("--paper", action="store_true", help="show the paper's value and the difference per cell")
    parser.add_argument("--resamples", type=int, default=RESAMPLES, help=f"bootstrap resamples (default {RESAMPLES})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"bootstrap seed (default {SEED})")
    parser.add_argument("--leaderboard", nargs="+", metavar="EXPERIMENT", help="write only the leaderboard of these "
                        "experiments' runs (options of pcs/conf/experiment; an item with = overrides them all, as "
                        "the sweep was run), to DIR/README.md")
    parser.add_argument("--bench", nargs="+", type=Path, default=[], metavar="JSONL",
                        help="pcs.bench files (--json) giving the leaderboard's prefill and decode times")
    args = parser.parse_args(argv)
    # Only now the heavy part (pandas, matplotlib): --help and a wrong argument answer at once.
    from .collect import same_cells
    from .document import build, build_leaderboard
    if not args.results.exists():
        parser.error(f"--results {args.results} does not exist")
    if args.leaderboard:
        command_line = " ".join(["python -m pcs.report", *(sys.argv[1:] if argv is None else argv)])
        written = build_leaderboard(args.results, args.leaderboard, args.bench, args.out, args.resamples, args.seed,
                                    command_line.replace(str(Path.cwd()) + "/", ""))
        print(f"[pcs] leaderboard: {written}")
        return 0
    print(f"[pcs] report: {build(args.results, args.out, args.paper, args.resamples, args.seed)}")
    if args.results.is_dir():
        for used, others in same_cells(args.results):
            print(f"[pcs] {used.relative_to(args.results)} is also in "
                  f"{', '.join(str(o.relative_to(args.results)) for o in others)}: the report uses the first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
