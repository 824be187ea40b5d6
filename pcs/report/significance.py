"""Paired bootstrap intervals: is a "with vs without selection" difference, or a budget saving, real?

Two runs that differ only in ``selection`` score the same samples, so the per-sample differences
(candidate minus attention, paired by ``id``) carry the comparison. A bootstrap replicate resamples
samples with replacement, within strata: LongBench's score is the mean of its task scores, so each
task is resampled on its own and the replicate is the mean of task means (a domain's, over its
tasks), which keeps the benchmark's weighting; other benchmarks are one stratum. The interval is the
replicates' 2.5 and 97.5 percentiles (for 95 %); ``p_value`` is twice the smaller share of
replicates on either side of zero (capped at 1). A fixed seed makes the report reproducible.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..benchmarks.longbench_data import DOMAINS
from ..benchmarks.ruler_data import GROUPS, domain_name
from ..identity import RunIdentity
from ..paths import read_jsonl
from ..run_folder import saved_config
from . import LEVEL, RESAMPLES, SEED
from .savings import ABOVE, BELOW, equivalent_budget

CHUNK = 1_000   # replicates drawn at a time, to bound memory on large runs
# Samples every stratum needs for an interval: a stratum of 1 sample, or of 2 equal ones, never varies under
# resampling, and a few understate its spread, so such an interval would look certain where nothing is known.
MIN_STRATUM = 10


def too_few(strata: list[np.ndarray]) -> bool:
    """Whether some stratum holds fewer than ``MIN_STRATUM`` samples (then no interval is given)."""
    return min(len(s) for s in strata) < MIN_STRATUM


class UnpairedError(ValueError):
    """Two runs whose samples differ cannot be compared sample by sample."""


@dataclass(frozen=True)
class Interval:
    """A stratified mean of ``n`` samples and its interval; ``ci_low``, ``ci_high`` and ``p_value`` are NaN where a
    stratum holds fewer than ``MIN_STRATUM`` samples."""
    n: int
    delta: float
    ci_low: float
    ci_high: float
    p_value: float

    @property
    def excludes_zero(self) -> bool:
        return self.ci_low > 0 or self.ci_high < 0


def stratified_mean(values: np.ndarray, strata: list[np.ndarray]) -> float:
    """The benchmark's aggregate: the mean over strata of each stratum's mean."""
    return float(np.mean([values[s].mean() for s in strata]))


def replicates(values: np.ndarray, strata: list[np.ndarray], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(resamples, k) stratified bootstrap replicates of ``stratified_mean`` for the k columns of
    ``values`` (n, k), with the same resampled samples for every column (paired)."""
    out = np.empty((resamples, values.shape[1]))
    for start in range(0, resamples, CHUNK):
        r = min(CHUNK, resamples - start)
        total = np.zeros((r, values.shape[1]))
        for members in strata:
            # The stratum's values gathered once, then each replicate's picks among them: the same numbers as
            # picking the samples' indices first, in a third of the time for one column.
            own = values[members]                                                       # (n_s, k)
            picks = rng.integers(0, len(members), size=(r, len(members)))              # (r, n_s)
            total += own[:, 0][picks].mean(axis=1)[:, None] if own.shape[1] == 1 else own[picks].mean(axis=1)
        # Rounded far below any score's resolution, so that a replicate equal to zero is exactly zero.
        out[start:start + r] = np.round(total / len(strata), 9)
    return out


def percentile_interval(draws: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def paired_bootstrap(differences, strata: list[np.ndarray] | None = None, resamples: int = RESAMPLES,
                     seed: int = SEED, level: float = LEVEL) -> Interval:
    """Interval and two-sided p-value of the (stratified) mean of paired ``differences``."""
    d = np.asarray(differences, dtype=float)
    strata = strata or [np.arange(len(d))]
    # A report asks for the same comparison from several tables (a run's effect in its benchmark's section, the
    # significance table and the leaderboard): the draws depend on nothing else, so each is drawn once.
    rows = [np.flatnonzero(s) if np.asarray(s).dtype == bool else np.asarray(s, dtype=np.int64) for s in strata]
    return _bootstrap(d.tobytes(), tuple(r.tobytes() for r in rows), resamples, seed, level)


@functools.lru_cache(maxsize=8192)
def _bootstrap(differences: bytes, strata: tuple[bytes, ...], resamples: int, seed: int, level: float) -> Interval:
    d, strata = np.frombuffer(differences), [np.frombuffer(s, dtype=np.int64) for s in strata]
    n, delta = int(sum(len(s) for s in strata)), stratified_mean(d, strata)
    if too_few(strata):
        return Interval(n, delta, float("nan"), float("nan"), float("nan"))
    draws = replicates(d[:, None], strata, resamples, np.random.default_rng(seed))[:, 0]
    low, high = percentile_interval(draws, level)
    p = min(1.0, 2 * min(float((draws <= 0).mean()), float((draws >= 0).mean())))
    return Interval(n, delta, low, high, p)


def run_scores(run_dir: Path) -> pd.DataFrame:
    """A finished run's per-sample scores: columns ``id``, ``score``, ``stratum`` (LongBench's task, RULER's task
    and length), ``task`` and ``length``."""
    path = Path(run_dir) / "predictions.jsonl"
    if not path.exists():
        raise ValueError(f"{run_dir}: no predictions.jsonl")
    return scores_frame(read_jsonl(path), run_dir)


def scores_frame(rows: list[dict], run_dir: Path) -> pd.DataFrame:
    """``run_scores``' frame of prediction rows."""
    # A benchmark whose score averages finer cells than tasks (RULER: task x length) names them in ``stratum``.
    frame = pd.DataFrame({"id": [r["id"] for r in rows], "score": [r.get("score") for r in rows],
                          "stratum": [r.get("stratum", r.get("task", "")) for r in rows],
                          "task": [r.get("task", "") for r in rows], "length": [r.get("length") for r in rows]})
    if frame["score"].isna().any():
        raise ValueError(f"{run_dir}: some samples have no score (AlpacaEval is judged over the whole set)")
    return frame


def paired(runs: list[pd.DataFrame]) -> pd.DataFrame:
    """Scores of several runs side by side (columns 0..k-1), one row per shared id; refuses runs whose
    sample ids differ, since pairing them would compare different samples."""
    ids = [set(r["id"]) for r in runs]
    if any(i != ids[0] for i in ids[1:]) or any(r["id"].duplicated().any() for r in runs):
        differ = len(set.union(*ids) - set.intersection(*ids))
        raise UnpairedError(f"the runs do not score the same samples ({differ} ids are not in all of them)")
    order = runs[0][["id", "stratum", "task", "length"]]
    columns = {i: r.set_index("id").loc[order["id"], "score"].to_numpy(dtype=float) for i, r in enumerate(runs)}
    return pd.DataFrame({key: order[key].to_numpy() for key in order} | columns)


def strata_of(table: pd.DataFrame, tasks: list[str] | None = None, length=None) -> list[np.ndarray]:
    """Row indices per stratum, optionally only of ``tasks`` and of one ``length`` (RULER's)."""
    keep = table["task"].isin(tasks) if tasks is not None else pd.Series(True, index=table.index)
    if length is not None:
        keep &= table["length"] == length
    groups = table[keep].groupby("stratum", sort=True).indices
    rows = table.index[keep].to_numpy()
    return [rows[np.asarray(members)] for members in groups.values()]


def longbench_domains(table: pd.DataFrame) -> dict[str, list[np.ndarray]]:
    """LongBench's domains present in the run (each the mean of its tasks)."""
    tasks = set(table["task"])
    return {domain: strata_of(table, members) for domain, members in DOMAINS.items() if tasks & set(members)}


def ruler_domains(table: pd.DataFrame) -> dict[str, list[np.ndarray]]:
    """Per length, each RULER group present and the mean over tasks, named as the run's metrics name them."""
    out = {}
    for length in sorted(set(table["length"])):
        out[domain_name("mean", length)] = strata_of(table, length=length)
        for group, members in GROUPS.items():
            if set(table["task"][table["length"] == length]) & set(members):
                out[domain_name(group, length)] = strata_of(table, members, length)
    return out


DOMAINS_OF = {"longbench": longbench_domains, "ruler": ruler_domains}   # benchmark -> its score's parts


def domains_of(table: pd.DataFrame, benchmark: str) -> dict[str, list[np.ndarray]]:
    """``average`` (the run's score: the mean over every stratum) and the benchmark's parts of it."""
    parts = DOMAINS_OF.get(benchmark)
    return {"average": strata_of(table), **(parts(table) if parts else {})}


SIGNIFICANCE_COLUMNS = ["model", "benchmark", "variant", "method", "budget", "selection", "domain", "n", "delta", "ci_low",
                        "ci_high", "p_value", "note", "run_dir", "baseline_run_dir"]


def identity(run_dir: Path) -> RunIdentity:
    return RunIdentity(saved_config(run_dir))


def significance(run_dirs: list[Path], baseline: str = "attention", resamples: int = RESAMPLES,
                 seed: int = SEED) -> pd.DataFrame:
    """One row per (candidate run, domain) for every pair of finished runs that differ only in selection."""
    groups: dict[str, dict[str, Path]] = {}
    for run_dir in run_dirs:
        run = identity(run_dir)
        groups.setdefault(run.pairing_key, {})[run.selection_label] = run_dir
    rows = []
    for by_label in groups.values():
        if baseline not in by_label:
            continue
        for label, run_dir in sorted(by_label.items()):
            if label == baseline:
                continue
            rows += pair_rows(by_label[baseline], run_dir, label, resamples, seed)
    return pd.DataFrame(rows, columns=SIGNIFICANCE_COLUMNS)


def pair_rows(base_dir: Path, cand_dir: Path, label: str, resamples: int, seed: int) -> list[dict]:
    run = identity(cand_dir)
    cfg = run.cfg
    common = {"model": cfg.model.name, "benchmark": cfg.benchmark.name, "variant": run.variant, "method": cfg.method.name,
              "budget": cfg.get("budget"), "selection": label, "run_dir": str(cand_dir),
              "baseline_run_dir": str(base_dir)}
    try:
        table = paired([run_scores(base_dir), run_scores(cand_dir)])
    except ValueError as err:      # unpaired, or no per-sample scores: reported, never paired silently
        return [{**common, "domain": "average", "n": None, "note": str(err)}]
    difference = (table[1] - table[0]).to_numpy()
    return [{**common, "domain": domain, **vars(paired_bootstrap(difference, strata, resamples, seed)), "note": ""}
            for domain, strata in domains_of(table, cfg.benchmark.name).items()]


BEYOND = 1e12      # how far past the measured range a replicate out of it is put (any budget is far less)
SAVINGS_CI_COLUMNS = ["equivalent_budget_ci_low", "equivalent_budget_ci_high", "savings_pct_ci_low",
                      "savings_pct_ci_high", "ci_low_beyond", "ci_high_beyond", "resamples_in_range", "ci_note"]


def savings_intervals(saved: pd.DataFrame, df: pd.DataFrame, baseline: str = "attention",
                      candidate: str = "perturbation", resamples: int = RESAMPLES, seed: int = SEED) -> pd.DataFrame:
    """``saved`` (from ``savings``) with intervals on ``equivalent_budget`` and ``savings_pct``: each
    replicate resamples the samples behind every point of the curve together (the same ids in all
    runs) and recomputes the equivalent budget. A replicate whose score falls outside the measured range has
    an equivalent budget beyond that range's end, unknown by how much: it counts, and a bound of the interval
    that falls among such replicates is cut at that end (``ci_low_beyond``, ``ci_high_beyond``: "below" or
    "above" where the true bound lies past the end it holds, else ""). ``resamples_in_range`` counts the others."""
    out = []
    avg = df[(df["domain"] == "average") & df["run_dir"].notna()]
    for _, row in saved.iterrows():
        group = avg[(avg["table"] == row["table"]) & (avg["model"] == row["model"]) & (avg["method"] == row["method"])]
        base = group[group["selection"] == baseline].drop_duplicates("budget").sort_values("budget")
        cand = group[(group["selection"] == candidate) & (group["budget"] == row["budget"])]
        out.append(saving_interval(base, cand, int(row["budget"]), resamples, seed))
    return pd.concat([saved.reset_index(drop=True), pd.DataFrame(out, columns=SAVINGS_CI_COLUMNS)], axis=1)


def saving_interval(base: pd.DataFrame, cand: pd.DataFrame, budget: int, resamples: int, seed: int) -> dict:
    empty = dict.fromkeys(SAVINGS_CI_COLUMNS)
    if cand.empty or len(base) < 2:
        return {**empty, "ci_note": "no per-sample runs behind this point"}
    try:
        table = paired([run_scores(Path(r)) for r in [*base["run_dir"], cand["run_dir"].iloc[0]]])
    except ValueError as err:
        return {**empty, "ci_note": str(err)}
    k = len(base)
    values = table[list(range(k + 1))].to_numpy()
    strata = strata_of(table)
    if too_few(strata):
        return {**empty, "ci_note": f"a stratum holds fewer than {MIN_STRATUM} samples: no interval"}
    draws = replicates(values, strata, resamples, np.random.default_rng(seed))
    budgets = base["budget"].tolist()
    ends = (min(budgets), max(budgets))
    # past the range's end by an unknown amount: stand-ins far beyond it, so that a percentile that reaches one
    # lands outside the range (every equivalent budget inside it lies between its ends)
    beyond = {BELOW: ends[0] - BEYOND, ABOVE: ends[1] + BEYOND}
    equivalent = np.array([eq if eq is not None else beyond[why]
                           for eq, why in (equivalent_budget(budgets, list(d[:k]), d[k]) for d in draws)])
    inside = int(((equivalent >= ends[0]) & (equivalent <= ends[1])).sum())
    bounds = percentile_interval(equivalent)
    beyond_ends = ["below" if bound < ends[0] else "above" if bound > ends[1] else "" for bound in bounds]
    eq_low, eq_high = (min(max(bound, ends[0]), ends[1]) for bound in bounds)
    return {"equivalent_budget_ci_low": round(eq_low, 1), "equivalent_budget_ci_high": round(eq_high, 1),
            "savings_pct_ci_low": round(100 * (1 - budget / eq_low), 1),
            "savings_pct_ci_high": round(100 * (1 - budget / eq_high), 1),
            "ci_low_beyond": beyond_ends[0], "ci_high_beyond": beyond_ends[1],
            "resamples_in_range": inside, "ci_note": ""}
