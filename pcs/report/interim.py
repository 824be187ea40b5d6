"""Where a knob ablation stands while its runs are still going: each reading against attention-only selection and
the paper reading under the same conventions, on the samples every run of its group has answered so far.

    python -m pcs.report.interim results/embedded/ruler/gemma3_270m --setting query_aware=False

The report (``python -m pcs.report``) compares finished runs only. This takes every run folder under the given
folders, finished or not, groups them as the report does (``pcs.report.ablation.readings``), keeps the samples
all runs of a group hold, and prints per group the paired difference on the mean over strata with its 95 %
stratified bootstrap interval (10,000 resamples, seed 0, as the report). A partial run answers its samples one
stratum at a time in turn, so the shared samples cover every task and length alike; the intervals are those of
the samples so far and narrow as the runs go on. Rows are read as a resuming job reads them (shards included, a
torn last line dropped), and per stratum only the first samples every run has answered count: in a decode pool
answers may land out of order (short ones first), and a hole in one run must not bias which samples are shared.
Under each table: the widest half-width, and the samples it projects for every interval to be within
``--target`` (a half-width shrinks as one over the square root of the samples, at the spread so far).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from . import RESAMPLES, SEED
from ..cli import command


def prefixes(frames: dict) -> set[str]:
    """The ids of each stratum's first samples (``<stratum>_<index>``, index 0, 1, ...) that every frame holds."""
    shared = set()
    for stratum in set.intersection(*(set(frame["stratum"]) for frame in frames.values())):
        held = [set(frame["id"][frame["stratum"] == stratum]) for frame in frames.values()]
        index = 0
        while all(f"{stratum}_{index}" in ids for ids in held):
            shared.add(f"{stratum}_{index}")
            index += 1
    return shared


def main(argv=None) -> int:
    parser = command("pcs.report.interim", __doc__)
    parser.add_argument("folders", type=Path, nargs="+", help="folders holding run folders (finished or not)")
    parser.add_argument("--setting", default="", help="only groups whose setting contains this text")
    parser.add_argument("--resamples", type=int, default=RESAMPLES, help=f"bootstrap resamples (default {RESAMPLES})")
    parser.add_argument("--target", type=float, default=3.0, help="the half-width, in points, to project the samples needed for (default 3)")
    args = parser.parse_args(argv)
    # pandas and the bootstrap load only once the arguments are read, so --help answers at once
    from .ablation import ATTENTION, mean_domains, readings
    from .significance import paired, paired_bootstrap, scores_frame
    from ..run_folder import all_rows
    run_dirs = sorted(p.parent for folder in args.folders for p in folder.glob("*/config.yaml")
                      if (p.parent / "predictions.jsonl").exists())
    for group, members in sorted(readings(run_dirs).items(), key=lambda kv: str(kv[0])):
        model, benchmark, setting, method, budget = group
        if args.setting not in setting or len(members) < 2:
            continue
        scores = {key: scores_frame(all_rows(reading.run_dir), reading.run_dir) for key, reading in members.items()}
        shared = prefixes(scores)
        scores = {key: frame[frame["id"].isin(shared)].reset_index(drop=True) for key, frame in scores.items()}
        print(f"\n### {model}, {benchmark}, {setting}, {method}, budget {budget}: {len(shared)} samples shared by "
              f"{len(members)} runs\n")
        print("| conventions | selection | score | vs w/o | vs paper knobs |\n|---|---|---:|---|---|")
        widest = 0.0
        for (conventions, selection), reading in sorted(members.items()):
            cells = []
            for baseline in (reading.baseline("w/o"), reading.baseline("paper knobs")):
                # attention-only selection is the baseline, as in the report
                if selection == ATTENTION or baseline not in members or baseline == (conventions, selection):
                    cells.append("-")
                    continue
                table = paired([scores[baseline], scores[(conventions, selection)]])
                strata = mean_domains(table)["average"]
                interval = paired_bootstrap((table[1] - table[0]).to_numpy(), strata, args.resamples, SEED)
                cells.append(f"{interval.delta:+.1f} [{interval.ci_low:+.1f}, {interval.ci_high:+.1f}]")
                widest = max(widest, (interval.ci_high - interval.ci_low) / 2)
            frame = scores[(conventions, selection)]
            score = frame.groupby("stratum")["score"].mean().mean()
            print(f"| {conventions or 'paper'} | {selection if selection != ATTENTION else 'attention'} | "
                  f"{score:.1f} | {cells[0]} | {cells[1]} |")
        if widest:
            print(f"\nwidest half-width {widest:.1f}: about {samples_for(widest, len(shared), args.target)} samples "
                  f"for every interval within +-{args.target:g}")
    return 0


def samples_for(half_width: float, samples: int, target: float) -> int:
    """Samples at which a half-width of ``half_width`` on ``samples`` would shrink to ``target``."""
    return math.ceil(samples * (half_width / target) ** 2)


if __name__ == "__main__":
    sys.exit(main())
