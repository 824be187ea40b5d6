"""Tables shaped like the paper's LongBench tables: rows = task domains and their average, columns =
full cache, then per budget one column per selection the paper reports (without, then with perturbation
selection); one block per model. Written as Markdown, CSV and LaTeX (booktabs); the best of each budget's
selections is bold. With a paper frame, each measured cell also shows the paper's value and the
difference.

Other readings of a selection (changed knobs) and runs under other conventions go to the side-by-side
tables instead: one per benchmark, model and setting, a row per method, conventions and selection, a column
per budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..benchmarks.ruler_data import GROUPS

DOMAINS = ["single_doc_qa", "multi_doc_qa", "summarization", "few_shot", "synthetic", "code", "average"]
DOMAIN_NAMES = {"single_doc_qa": "Single-Doc QA", "multi_doc_qa": "Multi-Doc QA", "summarization": "Summarization",
                "few_shot": "Few-shot", "synthetic": "Synthetic", "code": "Code", "average": "Average"}
SELECTION_ORDER = ["none", "attention", "perturbation_alpha0", "perturbation"]
SELECTION_NAMES = {"attention": "w/o", "perturbation": "w/", "perturbation_alpha0": "alpha=0", "none": ""}


def part_key(domain: str):
    """RULER's parts (``retrieval_2048``, ``mean_2048``) by length, then in RULER's group order, the mean last."""
    group, _, length = domain.rpartition("_")
    if not length.isdigit():
        return (0, 0, domain)
    order = [*GROUPS, "mean"]
    return (int(length), order.index(group) if group in order else len(order), domain)


def selection_key(label: str):
    return (SELECTION_ORDER.index(label) if label in SELECTION_ORDER else len(SELECTION_ORDER), label)


def columns_of(df: pd.DataFrame) -> list[tuple]:
    """("full", None) first (the run without a budget: the full cache), then (budget, selection) in budget
    order, baseline before candidate."""
    cols = [("full", None)] if df["budget"].isna().any() else []
    compressed = df[df["budget"].notna()][["budget", "selection"]].drop_duplicates()
    return cols + sorted(((int(b), s) for b, s in compressed.itertuples(index=False)),
                         key=lambda c: (c[0], selection_key(c[1])))


def cell_row(df: pd.DataFrame, model: str, domain: str, col: tuple):
    if col[0] == "full":
        hit = df[(df["model"] == model) & df["budget"].isna() & (df["domain"] == domain)]
    else:
        hit = df[(df["model"] == model) & (df["budget"] == col[0])
                 & (df["selection"] == col[1]) & (df["domain"] == domain)]
    return None if hit.empty else hit.iloc[0]


def cell_value(df: pd.DataFrame, model: str, domain: str, col: tuple):
    row = cell_row(df, model, domain, col)
    return None if row is None else float(row["score"])


def significant_cells(tested: pd.DataFrame | None) -> set[tuple[str, str]]:
    """(run folder, domain) of every difference to attention-only selection whose interval excludes zero."""
    if tested is None or tested.empty:
        return set()
    hits = tested[(tested["note"] == "") & ((tested["ci_low"] > 0) | (tested["ci_high"] < 0))]
    return set(zip(hits["run_dir"], hits["domain"]))


def block(df: pd.DataFrame, model: str, paper: pd.DataFrame | None = None,
          significant: set[tuple[str, str]] = frozenset()) -> list[dict]:
    """Rows of one model's block: domain, then per column the value, its paper value, bold, and
    whether its difference to the same budget's attention-only cell is significant."""
    cols = columns_of(df)
    present = set(df["domain"])
    domains = [d for d in DOMAINS[:-1] if d in present] + sorted(present - set(DOMAINS), key=part_key) + ["average"]
    budgeted = df[df["budget"].notna()]["method"]
    method = budgeted.iloc[0] if len(budgeted) else df["method"].iloc[0]
    rows = []
    for domain in domains:
        cells = {}
        for col in cols:
            row = cell_row(df, model, domain, col)
            ref = None
            if paper is not None:
                ref = cell_value(paper[(paper["method"] == method) | paper["budget"].isna()], model, domain, col)
            cells[col] = {"value": None if row is None else float(row["score"]), "paper": ref, "bold": False,
                          "significant": row is not None and (row["run_dir"], domain) in significant}
        for budget in {c[0] for c in cols if c[0] != "full"}:
            group = [c for c in cols if c[0] == budget and cells[c]["value"] is not None]
            if len(group) >= 2:
                best = max(cells[c]["value"] for c in group)
                for c in group:
                    cells[c]["bold"] = cells[c]["value"] == best
        rows.append({"domain": domain, "cells": cells})
    return rows


def header(col: tuple) -> str:
    if col[0] == "full":
        return "Full"
    name = SELECTION_NAMES.get(col[1], col[1])
    return f"{col[0]} {name}".strip()


def fmt(cell: dict, bold: tuple[str, str], with_paper: bool) -> str:
    if cell["value"] is None:
        return "-"
    text = f"{cell['value']:.2f}"
    if cell["bold"]:
        text = f"{bold[0]}{text}{bold[1]}"
    if cell.get("significant"):
        text += bold[2]
    if with_paper and cell["paper"] is not None:
        text += f" ({cell['paper']:.2f}, {cell['value'] - cell['paper']:+.2f})"
    return text


def markdown(name: str, blocks: dict[str, list[dict]], with_paper: bool, protocol: str | None = None) -> str:
    lines = [f"## {name}", ""] + ([f"Protocol: {protocol}.", ""] if protocol else [])
    if with_paper:
        lines += ["Each cell: measured (paper, measured - paper).", ""]
    if any(c.get("significant") for rows in blocks.values() for r in rows for c in r["cells"].values()):
        lines += ["\\*: the 95 % paired bootstrap interval of the difference to w/o excludes zero "
                  "(significance.csv).", ""]
    for model, rows in blocks.items():
        cols = list(rows[0]["cells"])
        lines += [f"**{model}**", "", "| Domain | " + " | ".join(header(c) for c in cols) + " |",
                  "|---|" + "---:|" * len(cols)]
        lines += ["| " + DOMAIN_NAMES.get(r["domain"], r["domain"]) + " | "
                  + " | ".join(fmt(r["cells"][c], ("**", "**", "\\*"), with_paper) for c in cols) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def latex(name: str, blocks: dict[str, list[dict]], with_paper: bool) -> str:
    first = next(iter(blocks.values()))
    cols = list(first[0]["cells"])
    out = [f"% {name}", r"\begin{tabular}{l" + "r" * len(cols) + "}", r"\toprule",
           "Domain & " + " & ".join(header(c).replace("_", r"\_") for c in cols) + r" \\"]
    for model, rows in blocks.items():
        out += [r"\midrule", rf"\multicolumn{{{len(cols) + 1}}}{{l}}{{\textit{{{model.replace('_', chr(92) + '_')}}}}} \\",
                r"\midrule"]
        for r in rows:
            cells = [fmt(r["cells"].get(c, {"value": None}), (r"\textbf{", "}", r"$^{*}$"), with_paper) for c in cols]
            out.append(DOMAIN_NAMES.get(r["domain"], r["domain"]).replace("_", r"\_") + " & " + " & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}", ""]
    return "\n".join(out)


def wide_csv(blocks: dict[str, list[dict]]) -> pd.DataFrame:
    records = []
    for model, rows in blocks.items():
        for r in rows:
            rec = {"model": model, "domain": r["domain"]}
            for col, cell in r["cells"].items():
                key = "full" if col[0] == "full" else f"b{col[0]}_{col[1]}"
                rec[key] = cell["value"]
                if cell["paper"] is not None:
                    rec[f"{key}_paper"] = cell["paper"]
            records.append(rec)
    return pd.DataFrame(records)


@dataclass(frozen=True)
class Written:
    markdown: str
    columns: int    # cells per row: one alone compares nothing (the side-by-side tables hold such runs)


def write_tables(df: pd.DataFrame, out: Path, paper: pd.DataFrame | None = None,
                 tested: pd.DataFrame | None = None) -> dict[str, Written]:
    """One Markdown, CSV and LaTeX file per table under ``out/tables``, of the paper's selections only.
    ``tested`` (significance rows) marks cells whose difference to w/o is significant."""
    significant = significant_cells(tested)
    folder = Path(out) / "tables"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    papers = df[df["selection"].isin(SELECTION_ORDER) | df["budget"].isna()]
    for name, group in papers.groupby("table", sort=True):
        if group["budget"].isna().all():
            continue    # only the full cache's rows: every run of this table reads another selection
        blocks = {model: block(group, model, paper, significant) for model in group["model"].unique()}
        protocols = sorted(set(group["protocol"].dropna()))
        assert len(protocols) <= 1, f"table {name} holds runs of protocols {protocols}"   # the setting is in its name
        text = markdown(name, blocks, paper is not None, protocols[0] if protocols else None)
        (folder / f"{name}.md").write_text(text + "\n")
        (folder / f"{name}.tex").write_text(latex(name, blocks, paper is not None))
        wide_csv(blocks).to_csv(folder / f"{name}.csv", index=False)
        written[name] = Written(text, len(columns_of(group)))
    return written


def method_comparisons(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Every configuration side by side: per benchmark, model and setting of measured runs, one row per method,
    conventions and selection, one column per budget, the average score. Written where the paper-shaped tables
    do not already hold every run: two or more methods or conventions, or a selection they leave out."""
    measured = df[(df["domain"] == "average") & df["run_dir"].notna()]
    tables = {}
    for (benchmark, model, variant), group in measured.groupby(["benchmark", "model", "variant"], sort=True):
        compressed = group[group["budget"].notna()]
        configurations = compressed[["method", "conventions"]].drop_duplicates()
        if len(configurations) < 2 and compressed["selection"].isin(SELECTION_ORDER).all():
            continue
        wide = compressed.pivot(index=["method", "conventions", "selection"], columns="budget", values="score")
        wide.columns = [f"b{int(b)}" for b in wide.columns]
        full = group[group["budget"].isna()]
        wide.insert(0, "full", float(full["score"].iloc[0]) if not full.empty else None)
        name = "_".join(filter(None, ["methods", benchmark, model, variant]))
        tables[name] = wide.reset_index()
    return tables


def comparison_markdown(name: str, table: pd.DataFrame) -> str:
    """Markdown of one method comparison; the best score of each budget column in bold."""
    budgets = [c for c in table.columns if c.startswith("b")]
    lines = [f"## {name}", "", "| method | conventions | selection | " + " | ".join(["Full"] + budgets) + " |",
             "|---|---|---|" + "---:|" * (len(budgets) + 1)]
    best = {b: table[b].max() for b in budgets}
    for _, row in table.iterrows():
        cells = ["-" if pd.isna(row["full"]) else f"{row['full']:.2f}"]
        for b in budgets:
            value = row[b]
            cells.append("-" if pd.isna(value) else (f"**{value:.2f}**" if value == best[b] else f"{value:.2f}"))
        selection = SELECTION_NAMES.get(row["selection"], row["selection"]) or "-"
        conventions = row["conventions"] or "-"
        lines.append(f"| {row['method']} | {conventions} | {selection} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_method_comparisons(df: pd.DataFrame, out: Path) -> dict[str, str]:
    """``out/tables/methods_<benchmark>_<model>[_variant].{md,csv}``; returns name -> Markdown."""
    folder = Path(out) / "tables"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, table in method_comparisons(df).items():
        text = comparison_markdown(name, table)
        (folder / f"{name}.md").write_text(text)
        table.to_csv(folder / f"{name}.csv", index=False)
        written[name] = text
    return written
