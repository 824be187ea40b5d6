"""Whether a rerun of knob-ablation cells on other samples agrees with the ablation: for every effect of the
rerun's setting in ``ablation.csv`` (``python -m pcs.report``), the same effect (method, budget, conventions,
reading, baseline) in the ablation's setting, on the mean over tasks.

    python -m pcs.report.rerun results/embedded/report/ablation.csv \\
        --ablation lengths=2048_tasks=niah_single_1+niah_single_2 \\
        --rerun lengths=2048_n_samples=100_seed=43_tasks=niah_single_1+niah_single_2

The two estimates come from independent samples, so their difference has a 95 % interval of about
+-sqrt(h1^2 + h2^2) (h: each one's half-width). A rerun agrees where that interval contains zero; the table also
says whether the rerun's delta falls inside the ablation's own interval. Tested one by one, some of many effects
that truly agree fall outside by chance (of 36, at least one 84 % of the time), so the verdict is Holm's: each
difference's two-sided p-value (normal, from the same half-widths) against 0.05 corrected for the family. "Agrees"
means the rerun does not show the effect to differ, by more than about that half-width; it is no proof that the
two are equal. Exits 1 if any effect differs after the correction.
"""
from __future__ import annotations

import math
import sys
from ..cli import command


KEY = ["model", "method", "budget", "conventions", "selection", "knobs", "against"]
Z95 = 1.959964          # the normal quantile of a 95 % two-sided interval


def compare(effects, ablation: str, rerun: str):
    mean = effects[effects["domain"] == "average"].fillna({"conventions": "", "knobs": ""})
    a, r = mean[mean["setting"] == ablation], mean[mean["setting"] == rerun]
    if r.empty or a.empty:
        raise SystemExit(f"no effects for setting {ablation if a.empty else rerun} in the file")
    both = r.merge(a, on=KEY, suffixes=("_rerun", "_ablation"))
    both["difference"] = both["delta_rerun"] - both["delta_ablation"]
    both["difference_half_width"] = [math.hypot(x, y) for x, y in zip(both["half_width_rerun"],
                                                                      both["half_width_ablation"])]
    both["agrees"] = both["difference"].abs() <= both["difference_half_width"]
    both["p_value"] = [two_sided_p(d, h) for d, h in zip(both["difference"], both["difference_half_width"])]
    both["differs_holm"] = holm(both["p_value"].tolist())
    both["inside_ablation_interval"] = ((both["ci_low_ablation"] <= both["delta_rerun"])
                                        & (both["delta_rerun"] <= both["ci_high_ablation"]))
    return both


def two_sided_p(difference: float, half_width: float) -> float:
    """The p-value of a difference whose 95 % half-width is ``half_width``, under a normal approximation."""
    if half_width == 0:
        return 1.0 if difference == 0 else 0.0
    return math.erfc(abs(difference) / (half_width / Z95) / math.sqrt(2))


def holm(p_values: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down test: which hypotheses of "no difference" are rejected, the family's error at most alpha."""
    rejected = [False] * len(p_values)
    for rank, i in enumerate(sorted(range(len(p_values)), key=lambda j: p_values[j])):
        if p_values[i] > alpha / (len(p_values) - rank):
            break
        rejected[i] = True
    return rejected


def markdown(both) -> str:
    lines = ["| method | budget | reading | against | ablation (n) | rerun (n) | difference | agrees | rerun inside | "
             "p | differs (Holm) |", "|---|---:|---|---|---|---|---|---|---|---:|---|"]
    for _, row in both.iterrows():
        reading = " ".join(filter(None, [row["conventions"], row["selection"], row["knobs"]]))
        lines.append(
            f"| {row['method']} | {row['budget']} | {reading} | {row['against']} | "
            f"{row['delta_ablation']:+.1f} [{row['ci_low_ablation']:+.1f}, {row['ci_high_ablation']:+.1f}] "
            f"({row['n_ablation']}) | {row['delta_rerun']:+.1f} [{row['ci_low_rerun']:+.1f}, "
            f"{row['ci_high_rerun']:+.1f}] ({row['n_rerun']}) | {row['difference']:+.1f} "
            f"+-{row['difference_half_width']:.1f} | {'yes' if row['agrees'] else 'no'} | "
            f"{'yes' if row['inside_ablation_interval'] else 'no'} | {row['p_value']:.3f} | "
            f"{'yes' if row['differs_holm'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = command("pcs.report.rerun", __doc__)
    parser.add_argument("ablation_csv", help="the report's ablation.csv holding both settings' effects")
    parser.add_argument("--ablation", required=True, help="the ablation's setting (ablation.csv's column)")
    parser.add_argument("--rerun", required=True, help="the rerun's setting")
    args = parser.parse_args(argv)
    import pandas as pd            # loaded once the arguments are read, so --help answers at once
    both = compare(pd.read_csv(args.ablation_csv), args.ablation, args.rerun)
    print(markdown(both))
    print(f"\n{int(both['agrees'].sum())} of {len(both)} effects agree one by one; "
          f"{int(both['inside_ablation_interval'].sum())} reruns fall inside the ablation's interval; "
          f"{int(both['differs_holm'].sum())} differ after Holm's correction for {len(both)} comparisons")
    return 1 if both["differs_holm"].any() else 0


if __name__ == "__main__":
    sys.exit(main())
