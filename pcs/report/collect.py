"""Tidy score rows from a results folder (any depth of run folders) or from a CSV.

One row per (table, model, method, selection, budget, domain): ``domain`` is a LongBench domain or
``average`` (the run's ``score``: the 16-task mean for LongBench, the grid mean for the needle test).
``conventions`` is the method's changed knobs and profile (empty under the defaults), ``variant`` the model and
benchmark setting.
Run folders are grouped into tables by benchmark, method and any non-default knob, so runs that
differ in more than selection and budget never share a column; full-cache runs join every table of
their benchmark and model knobs.
"""
from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

import pandas as pd

from ..identity import RunIdentity
from ..run_folder import saved_config

COLUMNS = ["table", "benchmark", "model", "method", "selection", "budget", "domain", "score", "run_dir", "variant",
           "conventions", "protocol"]


def paper_tables() -> pd.DataFrame:
    """The paper's LongBench numbers (Tables 1, 2, 3, 5, 6, 8), shipped with the project."""
    return read_csv(resources.files("pcs") / "data" / "paper_longbench_tables.csv")


def read_csv(path) -> pd.DataFrame:
    df = pd.read_csv(path)
    missing = {"model", "method", "selection", "budget", "score"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    df = df.copy()
    if "domain" not in df:
        df["domain"] = "average"
    if "table" not in df:
        df["table"] = df["method"].where(df["budget"].notna(), None)   # the full cache joins every table
    df["benchmark"] = df.get("benchmark", "longbench")
    df["run_dir"] = None
    df["variant"] = ""
    df["conventions"] = ""
    df["protocol"] = "question inside"      # the paper compresses each question with its context
    return expand_full_rows(df[COLUMNS])


def expand_full_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Full-cache rows without a table join every table of their benchmark, model and knobs."""
    loose = df[df["table"].isna()]
    placed = [df[df["table"].notna()]]
    for _, row in loose.iterrows():
        same = df[(df["model"] == row["model"]) & (df["benchmark"] == row["benchmark"])
                  & (df["variant"] == row["variant"]) & df["table"].notna()]
        placed += [pd.DataFrame([{**row.to_dict(), "table": t}]) for t in same["table"].unique()]
    return pd.concat(placed, ignore_index=True)


def run_rows(run_dir: Path) -> list[dict]:
    cfg = saved_config(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if metrics.get("score") is None or cfg.benchmark.name == "perturbation":
        return []   # not scored yet (AlpacaEval before judging), or an analysis with its own section
    run = RunIdentity(cfg)
    common = {"table": run.table, "benchmark": cfg.benchmark.name, "model": cfg.model.name,
              "method": cfg.method.name, "selection": run.selection_label,
              "budget": cfg.budget if run.reads_budget else None, "run_dir": str(run_dir), "variant": run.setting,
              "conventions": "_".join(run.method_knobs), "protocol": run.protocol}
    rows = [{**common, "domain": domain, "score": value} for domain, value in metrics.get("domains", {}).items()]
    return rows + [{**common, "domain": "average", "score": metrics["score"]}]


def run_folders(path: Path, benchmark: str | None = None) -> list[Path]:
    """Finished run folders under ``path`` (optionally of one benchmark), one per cell (``same_cells``)."""
    found = []
    for folder in finished_folders(Path(path)):
        if benchmark is None or saved_config(folder).benchmark.name == benchmark:
            found.append(folder)
    return found


def finished_folders(path: Path) -> list[Path]:
    every = [m.parent for m in sorted(Path(path).rglob("metrics.json")) if (m.parent / "config.yaml").exists()]
    left_out = {folder for _, others in same_cells(path) for folder in others}
    return [folder for folder in every if folder not in left_out]


def same_cells(path: Path) -> list[tuple[Path, list[Path]]]:
    """Finished runs of one cell found in more than one folder under ``path`` (a run of the default beside the
    committed reference runs, say): per cell, the run the report uses and those it leaves out. It uses the run
    with the most samples, the one that finished last among those, so a comparison never counts a cell twice."""
    finished = tuple((str(m), m.stat().st_mtime_ns) for m in sorted(Path(path).rglob("metrics.json"))
                     if (m.parent / "config.yaml").exists())
    return _same_cells(finished)


@functools.lru_cache(maxsize=8)
def _same_cells(finished: tuple[tuple[str, int], ...]) -> list[tuple[Path, list[Path]]]:
    """``same_cells`` of the finished runs' metrics files (paths and modification times: read again when they
    change); a report asks once per section."""
    cells: dict[str, list[Path]] = {}
    for metrics, _ in finished:
        folder = Path(metrics).parent
        cells.setdefault(RunIdentity(saved_config(folder)).folder, []).append(folder)

    def preference(folder: Path):
        metrics = json.loads((folder / "metrics.json").read_text())
        return metrics.get("n_samples", 0), metrics.get("ended_at") or ""

    chosen = []
    for folders in cells.values():
        if len(folders) > 1:
            best = max(folders, key=preference)
            chosen.append((best, [f for f in folders if f != best]))
    return chosen


def collect(path) -> pd.DataFrame:
    """Score rows of a results folder or a tidy CSV (see the module docstring)."""
    path = Path(path)
    if path.is_file():
        return read_csv(path)
    rows = [row for folder in run_folders(path) for row in run_rows(folder)]
    if not rows:
        raise FileNotFoundError(f"no finished, scored run folder under {path}")
    return expand_full_rows(pd.DataFrame(rows)[COLUMNS])
