"""The report's documents: ``report.md`` with its sections (tables, significance, knob ablation, savings, needle,
RULER, needle heads, perturbation analysis) and the leaderboard's ``README.md``, each with its figures."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd

from ..identity import RunIdentity
from ..paths import read_jsonl
from ..run_folder import saved_config
from ..plots.ablation import ablation_figure
from ..plots.labels import setting_knobs
from ..plots.needle import needle_comparison, needle_heatmap
from ..plots.needle_heads import needle_heads_figure
from ..plots.leaderboard import leaderboard_figure
from ..plots.ruler import ruler_figure
from ..plots.savings import savings_plot
from .ablation import blocks as ablation_blocks, knob_effects, markdown as ablation_markdown
from .collect import collect, paper_tables, run_folders, same_cells
from . import needle_heads
from .leaderboard import leaderboard, markdown as leaderboard_markdown, tables as leaderboard_tables, \
    title as leaderboard_title, bench_rounds
from .ruler import length_deltas, plain, score_intervals
from .savings import savings
from . import RESAMPLES, SEED
from .significance import MIN_STRATUM, savings_intervals, significance
from .tables import write_method_comparisons, write_tables


def leaf(run_dir: Path) -> str:
    return f"{run_dir.parent.name}__{run_dir.name}"


def needle_section(results: Path, out: Path) -> list[str]:
    runs = run_folders(results, "needle")
    if not runs:
        return []
    folder = out / "needle"
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["## Needle-in-a-Haystack", ""]
    identities = {r: RunIdentity(saved_config(r)) for r in runs}
    # per model and setting (a protocol, a knob of the benchmark): grids compare runs that answered the same questions
    for model, setting in sorted({(i.cfg.model.name, i.setting) for i in identities.values()}):
        mine = [r for r, i in identities.items() if i.cfg.model.name == model and i.setting == setting]
        name = "_".join(filter(None, [model, setting]))
        budgets = sorted({identities[r].cfg.budget for r in mine if identities[r].reads_budget})
        for budget in budgets:
            grid = needle_comparison(mine, folder / f"{name}_grid_b{budget}.png", budget, setting_knobs(mine[0]))
            if grid is not None:
                lines += [f"![needle grid {name} b{budget}](needle/{grid.name})", ""]
    for run_dir in runs:
        needle_heatmap(run_dir, folder / f"{leaf(run_dir)}.png")
    lines += ["Per run: " + ", ".join(f"[{leaf(r)}](needle/{leaf(r)}.png)" for r in runs), ""]
    return lines


def ruler_section(results: Path, out: Path, tested, resamples: int, seed: int) -> list[str]:
    """Per model and setting, the plain comparison's scores with intervals (bars at one length, score against length
    at several; the knob ablation's other readings have their own figure)."""
    runs = [r for r in run_folders(results, "ruler") if plain(r)]
    if not runs:
        return []
    scores = score_intervals(runs, resamples, seed)
    deltas = length_deltas(tested)
    lines = []
    for (model, setting), block in scores.groupby(["model", "setting"], sort=True):
        name = "_".join(filter(None, [model, setting]))
        figure = ruler_figure(block, deltas, out / "ruler" / f"{name}.png", f"RULER, {model}",
                              setting_knobs(block["run_dir"].iloc[0]))
        if figure is not None:
            lines += [f"![RULER {name}](ruler/{figure.name})", ""]
    return ["## RULER", "", "Mean over tasks with its 95 % bootstrap interval (samples resampled within tasks); above "
            "each perturbation bar, its paired difference to attention-only selection [95 % interval] (tables by "
            "task group and length: `ruler_*` above)."] + [""] + lines if lines else []


def needle_heads_section(results: Path, out: Path) -> list[str]:
    """Each needle-heads analysis (``python -m pcs.needle_heads``) under the results: its table and figure."""
    files = needle_heads.analyses(results)
    if not files:
        return []
    lines = ["## Why the needle goes", "",
             "Per (layer, KV head), the share of the needle's value tokens (and of the rest of its sentence, the key) "
             "each run kept, and the query heads the full "
             "cache reads the needle with while it answers (retrieval heads: the 10 with the highest mean attention on "
             "the value over the samples it answers right).", ""]
    for path in files:
        analysis = needle_heads.load(path)
        name = str(path.relative_to(results).with_suffix("")).replace("/", "__")
        lines += needle_heads.markdown(analysis, name)
        kept = {analysis["labels"][run]: needle_heads.mean_kept(analysis, run) for run in analysis["runs"]}
        figure = needle_heads_figure(needle_heads.mean_retrieval(analysis), kept, needle_heads.top_heads(analysis),
                                     out / "needle_heads" / f"{name}.png", name)
        if figure is not None:
            lines += [f"![{name}](needle_heads/{figure.name})", ""]
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


def significance_section(results: Path, out: Path, resamples: int, seed: int):
    """``significance.csv`` and its summary: every pair of runs that differ only in selection."""
    table = significance(run_folders(results), resamples=resamples, seed=seed)
    table.to_csv(out / "significance.csv", index=False)
    if table.empty:
        return table, []
    lines = ["## Significance", "",
             f"Paired bootstrap over samples ({resamples} resamples, seed {seed}; LongBench resampled within tasks). "
             "delta = candidate minus attention-only selection; * marks an interval that excludes zero.", "",
             "| model | benchmark | method | budget | knobs | selection | domain | n | delta | 95 % interval | p |",
             "|---|---|---|---:|---|---|---|---:|---:|---|---:|"]
    for _, r in table.iterrows():
        if r["note"]:
            lines.append(f"| {r['model']} | {r['benchmark']} | {r['method']} | {r['budget']} | {r['variant']} | "
                         f"{r['selection']} | {r['domain']} | - | - | {r['note']} | - |")
            continue
        star = "*" if r["ci_low"] > 0 or r["ci_high"] < 0 else ""
        interval, p = (f"[{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]", f"{r['p_value']:.3f}") if not pd.isna(r["ci_low"]) \
            else (f"none: a stratum holds fewer than {MIN_STRATUM} samples", "-")
        lines.append(f"| {r['model']} | {r['benchmark']} | {r['method']} | {r['budget']} | {r['variant']} | "
                     f"{r['selection']} | {r['domain']} | {r['n']} | {r['delta']:+.2f}{star} | {interval} | {p} |")
    return table, lines + [""]


def ablation_section(results: Path, out: Path, resamples: int, seed: int) -> list[str]:
    """``ablation.csv``, a table and a figure per ablation: every reading of a knob ablation against its baselines."""
    effects = knob_effects(run_folders(results), resamples, seed)
    if effects.empty:
        return []
    effects.to_csv(out / "ablation.csv", index=False)
    lines = []
    for (model, benchmark, setting), block in ablation_blocks(effects):
        lines += ablation_markdown(block)
        name = "_".join(filter(None, [model, benchmark, setting]))
        figure = ablation_figure(block, out / "ablation" / f"{name}.png", f"Selection knobs: {model}, {benchmark}")
        if figure is not None:
            lines += [f"![selection knobs {name}](ablation/{figure.name})", ""]
    return (["## Selection knobs", "",
             "Each reading of the perturbation selection (its conventions, paper's unless named, and its changed "
             "knobs) on the mean over tasks, against attention-only selection under the same conventions (w/o), "
             "the paper's knobs under the same conventions, the same selection under the paper's conventions, and "
             "each reading one knob apart (that knob at its default, `without`, or at the value named): "
             f"delta [95 % paired bootstrap interval] ({resamples} resamples, seed {seed}); * excludes zero (each "
             "interval on its own, not corrected for the number of comparisons). "
             "Per length: `ablation.csv`; one figure per table (`ablation/`).", ""] + lines)


def savings_section(df, out: Path, with_intervals: bool, resamples: int, seed: int) -> list[str]:
    saved = savings(df)
    if with_intervals and not saved.empty:
        saved = savings_intervals(saved, df, resamples=resamples, seed=seed)
    saved.to_csv(out / "savings.csv", index=False)
    if saved.empty:
        return ["## Budget savings", "", "No model x method has both selections at two or more budgets.", ""]
    savings_plot(df, saved, out / "savings.png")
    lines = ["## Budget savings", "",
             "Budget attention-only selection would need to match perturbation selection (linear interpolation "
             "between measured budgets; saving = 1 - b / b_equivalent). The intervals resample the samples "
             "behind every point of the curve together (95 %, paired bootstrap); a bound written `< x` or `> x` "
             "falls beyond the measured budgets, so only its side of x is known.", "",
             "| table | model | method | budget | score | equivalent budget | saving | saving 95 % interval |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for _, r in saved.iterrows():
        eq = r["note"] if r["equivalent_budget"] is None or r["note"] else f"{r['equivalent_budget']:.1f}"
        pct = "-" if r["note"] else f"{r['savings_pct']:.1f} %"
        low, high = r.get("savings_pct_ci_low"), r.get("savings_pct_ci_high")
        past = [{"below": "< ", "above": "> "}.get(r.get(f"ci_{end}_beyond"), "") for end in ("low", "high")]
        interval = "-" if low is None or pd.isna(low) else f"[{past[0]}{low:.1f}, {past[1]}{high:.1f}] %"
        lines.append(f"| {r['table']} | {r['model']} | {r['method']} | {r['budget']} | {r['score']:.2f} | {eq} | "
                     f"{pct} | {interval} |")
    return lines + ["", "![savings](savings.png)", ""]


def duplicates_section(results: Path) -> list[str]:
    """Which run the report used where a cell was run in more than one folder."""
    found = same_cells(results)
    if not found:
        return []
    lines = ["## Cells run in more than one folder", "",
             "The report uses one run per cell: the one with the most samples, then the one that finished last.", "",
             "| used | left out |", "|---|---|"]
    for used, others in found:
        lines.append(f"| {used.relative_to(results)} | {', '.join(str(o.relative_to(results)) for o in others)} |")
    return lines + [""]


def build(results: Path, out: Path, with_paper: bool = False, resamples: int = RESAMPLES, seed: int = SEED) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Report: {results}", ""]
    try:
        df = collect(results)
    except FileNotFoundError:
        df = None
    tested, tested_lines = (significance_section(results, out, resamples, seed) if results.is_dir()
                            else (None, []))
    if df is not None:
        tables = write_tables(df, out, paper_tables() if with_paper else None, tested)
        compared = sorted(name for name, table in tables.items() if table.columns > 1)
        alone = sorted(set(tables) - set(compared))
        lines += ["# Tables", ""] + [tables[name].markdown for name in compared]
        if alone:
            lines += ["Tables of a single cell (no full cache, one budget and selection), not shown here:", ""]
            lines += [f"- [{name}](tables/{name}.md)" for name in alone] + [""]
        comparisons = write_method_comparisons(df, out)
        if comparisons:
            lines += ["# Methods side by side", "", "Average score per method, conventions (the method's changed knobs "
                      "and profile; - for the defaults) and selection (w/o: attention, w/: perturbation selection, "
                      "else its changed knobs; LaProx and StreamingLLM use none).", ""]
            lines += [comparisons[name] for name in sorted(comparisons)]
        lines += tested_lines + (ablation_section(results, out, resamples, seed) if results.is_dir() else [])
        lines += savings_section(df, out, results.is_dir(), resamples, seed)
    if results.is_dir():
        lines += needle_section(results, out) + ruler_section(results, out, tested, resamples, seed)
        lines += needle_heads_section(results, out)
        lines += perturbation_section(results, out)
    if len(lines) == 2:
        raise FileNotFoundError(f"nothing to report under {results}")
    if results.is_dir():
        lines += duplicates_section(results)
    index = out / "report.md"
    index.write_text("\n".join(lines) + "\n")
    return index


def build_leaderboard(results: Path, experiments: list[str], bench: list[Path], out: Path,
                      resamples: int = RESAMPLES, seed: int = SEED, command_line: str = "") -> Path:
    """``DIR/README.md``: the leaderboard of ``experiments``' runs, the command that makes it, and what it shows."""
    board = leaderboard(experiments, results, bench, resamples, seed)
    if board.empty:
        raise FileNotFoundError(f"no run of {' '.join(experiments)} under {results}")
    experiments = [e for e in experiments if "=" not in e]
    out.mkdir(parents=True, exist_ok=True)
    board.drop(columns="run_dir").to_csv(out / "leaderboard.csv", index=False)
    devices = sorted({json.loads((Path(d) / "metrics.json").read_text()).get("device", "?")
                      for d in board["run_dir"] if (Path(d) / "metrics.json").exists()})
    lines = ["# Leaderboard", "",
             f"Every method of experiment {', '.join(f'`{e}`' for e in experiments)}, run on "
             f"{', '.join(devices) or 'an unrecorded device'}; written {pd.Timestamp.now():%Y-%m-%d} by", "",
             f"    {command_line}", "",
             "Score: the mean over tasks, and over lengths in a table of several [95 % bootstrap interval, samples "
             "resampled within each task and length]. KV kept: the "
             "share of the full cache's entries. Prefill and decode: time relative to the full cache, from the bench "
             "files given (random prompts at the nearest context, a table of several lengths their mean; - where none "
             "was given). Last column: perturbation "
             "minus attention-only selection for the same method and budget on the same samples [95 % paired "
             f"interval], * where it excludes zero (each interval on its own; {resamples} resamples, seed {seed}). "
             "Methods without a selection (their own rule) show `none`. Runs in progress enter with the samples "
             "every run of the experiment has answered; a run with fewer than half the answers of the experiment's "
             "most-answered run stays out until it catches up (`python -m pcs.status` shows it), and meanwhile a second "
             "table after the main one holds every run on the samples all of them share. A table of follow-ups "
             "scores the follow-ups (their mean per "
             "sample) and adds the first question's score on the same caches and the follow-ups minus it [95 % "
             "paired]. A table of shares of the prompt is also given by compression ratio, as kvpress's "
             "leaderboard gives it.", ""]
    for path in bench:
        rows = read_jsonl(path)
        lines += [f"Bench `{path.name}`: `python -m pcs.bench --json` on {rows[0].get('device_name', '?')}, "
                  f"{', '.join(sorted({r['model'] for r in rows}))}: {bench_rounds(rows)}.", ""]
    for model, protocol, length, cohort, block in leaderboard_tables(board):
        lines += leaderboard_markdown(block)
        if cohort:        # a table of runs catching up is read, not drawn: its samples are few and growing
            continue
        # the paper's protocol keeps its figures' names; another's is in its figures' names
        name = "_".join([model, length] + ([re.sub(r"\W+", "_", protocol)] if protocol != "question inside" else []))
        figure = leaderboard_figure(block, out / f"{name}.png", leaderboard_title(model, length, protocol))
        if figure is not None:
            lines += [f"![{model} {length} {protocol}]({figure.name})", ""]
    models = ", ".join(sorted(board["model"].unique()))
    lines += [f"What this shows: how these methods rank on these tasks, lengths and budgets for {models}. What it "
              "does not: how they rank on larger models (8B and up) or on other tasks; that needs the same "
              "experiment run on a cluster with another `model=`.", ""]
    (out / "README.md").write_text("\n".join(lines))
    return out / "README.md"
