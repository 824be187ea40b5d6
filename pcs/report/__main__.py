"""``python -m pcs.report --results PATH --out DIR [--paper]``: the paper's tables, budget savings,
needle heatmaps and perturbation-analysis figures from a results folder or a tidy CSV.

PATH is a folder of run folders (any depth) or a CSV with columns model, method, selection, budget,
score (and optionally domain, table), such as the paper's own numbers, shipped as
``pcs/data/paper_longbench_tables.csv``. ``--paper`` puts the paper's value and the difference
beside each measured cell. Everything lands in DIR, indexed by ``DIR/report.md``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .collect import collect, paper_tables, run_folders
from .figures import needle_comparison, needle_heatmap, savings_plot
from .savings import savings


def leaf(run_dir: Path) -> str:
    return f"{run_dir.parent.name}__{run_dir.name}"


def needle_section(results: Path, out: Path) -> list[str]:
    runs = run_folders(results, "needle")
    if not runs:
        return []
    folder = out / "needle"
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["## Needle-in-a-Haystack", ""]
    configs = {r: OmegaConf.load(r / "config.yaml") for r in runs}
    for model in sorted({c.model.name for c in configs.values()}):
        mine = [r for r, c in configs.items() if c.model.name == model]
        budgets = sorted({configs[r].budget for r in mine if configs[r].method.name != "full"})
        for budget in budgets:
            grid = needle_comparison(mine, folder / f"{model}_grid_b{budget}.png", budget)
            if grid is not None:
                lines += [f"![needle grid {model} b{budget}](needle/{grid.name})", ""]
    for run_dir in runs:
        needle_heatmap(run_dir, folder / f"{leaf(run_dir)}.png")
    lines += ["Per run: " + ", ".join(f"[{leaf(r)}](needle/{leaf(r)}.png)" for r in runs), ""]
    return lines


def perturbation_section(results: Path, out: Path) -> list[str]:
    runs = run_folders(results, "perturbation")
    if not runs:
        return []
    lines = ["## Perturbation analysis", "",
             "| run | heads lower with candidate | mean relative reduction | Assumption 1 holds |",
             "|---|---:|---:|---:|"]
    figures = []
    for run_dir in runs:
        m = json.loads((run_dir / "metrics.json").read_text())
        target = out / "perturbation" / leaf(run_dir)
        target.mkdir(parents=True, exist_ok=True)
        for png in sorted(run_dir.glob("*.png")):
            shutil.copy2(png, target / png.name)
            figures.append(f"![{leaf(run_dir)} {png.stem}](perturbation/{leaf(run_dir)}/{png.name})")
        holds = "-" if m["assumption1_frac"] is None else f"{100 * m['assumption1_frac']:.1f} %"
        lines.append(f"| {leaf(run_dir)} | {m['heads_improved']} / {m['n_heads']} | "
                     f"{100 * m['mean_relative_reduction']:.1f} % | {holds} |")
    return lines + [""] + figures + [""]


def savings_section(df, out: Path) -> list[str]:
    saved = savings(df)
    saved.to_csv(out / "savings.csv", index=False)
    if saved.empty:
        return ["## Budget savings", "", "No model x method has both selections at two or more budgets.", ""]
    savings_plot(df, saved, out / "savings.png")
    lines = ["## Budget savings", "",
             "Budget attention-only selection would need to match perturbation selection (linear interpolation "
             "between measured budgets; saving = 1 - b / b_equivalent).", "",
             "| table | model | method | budget | score | equivalent budget | saving |", "|---|---|---|---:|---:|---:|---:|"]
    for _, r in saved.iterrows():
        eq = r["note"] if r["equivalent_budget"] is None or r["note"] else f"{r['equivalent_budget']:.1f}"
        pct = "-" if r["note"] else f"{r['savings_pct']:.1f} %"
        lines.append(f"| {r['table']} | {r['model']} | {r['method']} | {r['budget']} | {r['score']:.2f} | {eq} | {pct} |")
    return lines + ["", "![savings](savings.png)", ""]


def build(results: Path, out: Path, with_paper: bool = False) -> Path:
    from .tables import write_method_comparisons, write_tables
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Report: {results}", ""]
    try:
        df = collect(results)
    except FileNotFoundError:
        df = None
    if df is not None:
        tables = write_tables(df, out, paper_tables() if with_paper else None)
        lines += ["# Tables", ""] + [tables[name] for name in sorted(tables)]
        comparisons = write_method_comparisons(df, out)
        if comparisons:
            lines += ["# Methods side by side", "", "Average score per method and selection (w/o: attention, "
                      "w/: perturbation selection; LaProx and StreamingLLM use none).", ""]
            lines += [comparisons[name] for name in sorted(comparisons)]
        lines += savings_section(df, out)
    if results.is_dir():
        lines += needle_section(results, out) + perturbation_section(results, out)
    if len(lines) == 2:
        raise FileNotFoundError(f"nothing to report under {results}")
    index = out / "report.md"
    index.write_text("\n".join(lines) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcs.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="results folder or tidy CSV")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--paper", action="store_true", help="show the paper's value and the difference per cell")
    args = parser.parse_args(argv)
    if not args.results.exists():
        parser.error(f"--results {args.results} does not exist")
    print(f"[pcs] report: {build(args.results, args.out, args.paper)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
