"""A leaderboard: every run of an experiment's sweep (``experiment=leaderboard``) on the samples all of them have
answered, per model and context length, and per model over all its lengths together where it has several (the
mean over every task and length: the leaderboard's headline, its samples those of every length). Each row: the mean score over tasks with its 95 % bootstrap interval
(samples resampled within tasks), the share of the full cache's entries kept, prefill and decode time relative to
the full cache (from a ``pcs.bench`` file where one is given), and, where the method takes a selection, the paired
difference of perturbation to attention-only selection at the same budget [95 % interval]. A run far behind the
others (a method added late) is left out of its table and shown with every run in a second one (``CATCHING_UP``)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..identity import RunIdentity
from ..paths import read_jsonl
from ..run_folder import all_rows
from .significance import RESAMPLES, SEED, paired_bootstrap, scores_frame, strata_of

COLUMNS = ["model", "protocol", "length", "cohort", "method", "selection", "budget", "n", "score", "ci_low", "ci_high", "kv_kept",
           "prefill_rel", "decode_rel", "effect", "effect_low", "effect_high", "first", "first_low", "first_high",
           "loss", "loss_low", "loss_high", "run_dir"]


def experiment_runs(experiment: str, results: Path, overrides: list[str] = ()) -> dict[Path, RunIdentity]:
    """The run folders an experiment's sweep (with ``overrides``) writes under ``results`` (each once) that hold an
    answer there (their own or a shard's)."""
    from ..projection import sweep_configs
    runs = {}
    for cfg in sweep_configs([f"experiment={experiment}", *overrides]):
        identity = RunIdentity(cfg)
        path = results / identity.folder
        if path not in runs and all_rows(path):
            runs[path] = identity
    return runs


def answered(run_dir: Path) -> pd.DataFrame:
    """A run's answers so far (finished or not, its shards' included): ``scores_frame``'s columns and the share of
    entries kept; a run with follow-up questions scored on them (``follow_up_score``: its protocol's answers, the
    first question being the other protocol's)."""
    rows = all_rows(run_dir)
    first = None
    if rows and "follow_up_score" in rows[0]:
        first = [row["score"] for row in rows]
        rows = [{**row, "score": row["follow_up_score"]} for row in rows]
    frame = scores_frame(rows, run_dir)
    if first is not None:
        frame["first"] = first          # the first question's score, beside the follow-ups' mean
    frame["kv_kept"] = [r["kv_cache_bytes"] / r["kv_cache_bytes_full"] for r in rows]
    return frame.drop_duplicates("id", keep="last").sort_values("id", kind="stable").reset_index(drop=True)


def bench_costs(paths: list[Path]) -> pd.DataFrame:
    """Per (model, context, method, selection, budget): prefill and decode time over the full cache's in the same
    ``pcs.bench`` file."""
    rows = []
    for path in paths:
        bench = pd.DataFrame(read_jsonl(path))
        for (model, context), block in bench.groupby(["model", "context"]):
            full = block[block["method"] == "full"]
            if full.empty:
                continue
            for _, r in block.iterrows():
                rows.append({"model": model, "context": int(context), "method": r["method"],
                             "selection": r["selection"], "budget": r["budget"],
                             "prefill_rel": r["prefill_s"] / full["prefill_s"].iloc[0],
                             "decode_rel": r["decode_ms_per_token"] / full["decode_ms_per_token"].iloc[0]})
    return pd.DataFrame(rows, columns=["model", "context", "method", "selection", "budget", "prefill_rel",
                                       "decode_rel"])


def bench_rounds(rows: list[dict]) -> str:
    """How a bench file measured its contexts: "4096 tokens, medians of 2 rounds, 16 tokens decoded per round",
    one clause per context where the files' rounds differ (a context rerun on its own)."""
    by_context: dict[int, set] = {}
    for r in rows:
        by_context.setdefault(int(r["context"]), set()).add((r.get("repeats", "?"), r.get("decode_tokens", "?")))
    groups: dict[tuple, list[int]] = {}
    for context, ways in sorted(by_context.items()):
        for way in sorted(ways, key=str):
            groups.setdefault(way, []).append(context)
    return "; ".join(f"{', '.join(str(c) for c in contexts)} tokens, medians of {repeats} "
                     f"round{'s' if repeats != 1 else ''}, {tokens} tokens decoded per round"
                     for (repeats, tokens), contexts in groups.items())


def cost_of(costs: pd.DataFrame, identity: RunIdentity, length: int) -> tuple[float, float]:
    """The bench's relative (prefill, decode) time for a run's cell at the bench context nearest ``length``."""
    cfg = identity.cfg
    mine = costs[(costs["model"] == cfg.model.name) & (costs["method"] == cfg.method.name)
                 & (costs["selection"] == identity.selection_label)]
    if identity.reads_budget:
        mine = mine[mine["budget"].astype(float) == float(cfg.budget)]
    if mine.empty:
        return float("nan"), float("nan")
    nearest = mine.iloc[(mine["context"] - length).abs().argsort()[:1]]
    return float(nearest["prefill_rel"].iloc[0]), float(nearest["decode_rel"].iloc[0])


def leaderboard(experiments: list[str], results: Path, bench: list[Path] = (), resamples: int = RESAMPLES,
                seed: int = SEED) -> pd.DataFrame:
    """The rows of every experiment named in ``experiments``; its items with ``=`` are overrides of them all (as a
    sweep was run with: ``benchmark.n_samples=100``)."""
    costs = bench_costs(list(bench))
    overrides = [e for e in experiments if "=" in e]
    rows = []
    for experiment in [e for e in experiments if "=" not in e]:
        runs = experiment_runs(experiment, results, overrides)
        if not runs:
            continue
        frames = {path: answered(path) for path in runs}
        most = max(len(f) for f in frames.values())
        # a run started long after the others (a method added to the sweep) would shrink every row to its few
        # samples: it stays out of the main table until it has half of the most-answered run's, and meanwhile
        # every run is shown again on the samples all of them share, beside it (wider intervals, nothing hidden)
        admitted = {path: identity for path, identity in runs.items() if 2 * len(frames[path]) >= most}
        cohorts = [(MAIN, admitted)] + ([(CATCHING_UP, runs)] if len(admitted) < len(runs) else [])
        for cohort, members in cohorts:
            rows += cohort_rows(cohort, members, frames, costs, resamples, seed)
    return pd.DataFrame(rows, columns=COLUMNS)


MAIN, CATCHING_UP = "", "every run, those catching up included"


def cohort_rows(cohort: str, runs: dict, frames: dict, costs, resamples: int, seed: int) -> list[dict]:
    """The rows of ``runs`` on the samples all of them have answered, per length and over its lengths together."""
    shared = set.intersection(*(set(frames[path]["id"]) for path in runs))
    frames = {path: frames[path][frames[path]["id"].isin(shared)].reset_index(drop=True) for path in runs}
    rows = []
    for path, identity in runs.items():
        frame = frames[path]
        lengths = [int(length) for length in sorted(set(frame["length"]))]
        for length in [[length] for length in lengths] + ([lengths] if len(lengths) > 1 else []):
            rows.append(row(identity, path, frame, length, frames, runs, costs, resamples, seed) | {"cohort": cohort})
    return rows


def lengths_label(lengths: list[int]) -> str:
    """A row's ``length``: its one context length, or its lengths joined by ``+`` (``4096+8192``)."""
    return "+".join(str(length) for length in lengths)


def row(identity, path, frame, lengths: list[int], frames, runs, costs, resamples, seed) -> dict:
    cfg = identity.cfg
    at_length = frame["length"].isin(lengths)
    strata = strata_of(frame[at_length])       # each (task, length) a stratum: the mean weighs lengths alike
    score = paired_bootstrap(frame["score"].to_numpy(dtype=float), strata, resamples, seed)
    out = {"model": cfg.model.name, "protocol": identity.protocol, "length": lengths_label(lengths),
           "method": cfg.method.name,
           "selection": identity.selection_label, "budget": cfg.budget if identity.reads_budget else None,
           "n": score.n, "score": score.delta, "ci_low": score.ci_low, "ci_high": score.ci_high,
           "kv_kept": float(frame.loc[at_length, "kv_kept"].mean()), "effect": np.nan, "effect_low": np.nan,
           "effect_high": np.nan, "first": np.nan, "first_low": np.nan, "first_high": np.nan, "loss": np.nan,
           "loss_low": np.nan, "loss_high": np.nan, "run_dir": str(path)}
    if "first" in frame:      # follow-ups: the first question's score, and the follow-ups' against it, paired
        first = frame["first"].to_numpy(dtype=float)
        asked = paired_bootstrap(first, strata, resamples, seed)
        loss = paired_bootstrap(frame["score"].to_numpy(dtype=float) - first, strata, resamples, seed)
        out.update(first=asked.delta, first_low=asked.ci_low, first_high=asked.ci_high, loss=loss.delta,
                   loss_low=loss.ci_low, loss_high=loss.ci_high)
    out["prefill_rel"], out["decode_rel"] = np.mean([cost_of(costs, identity, length) for length in lengths], axis=0)
    if identity.reads_selection and cfg.selection.name != "attention":
        base = next((p for p, i in runs.items() if i.cfg.method.name == cfg.method.name
                     and i.reads_selection and i.cfg.selection.name == "attention" and i.cfg.budget == cfg.budget
                     and i.cfg.model.name == cfg.model.name and i.setting == identity.setting), None)
        if base is not None:
            other = frames[base].set_index("id").loc[frame["id"], "score"].to_numpy(dtype=float)
            effect = paired_bootstrap(frame["score"].to_numpy(dtype=float) - other, strata, resamples, seed)
            out.update(effect=effect.delta, effect_low=effect.ci_low, effect_high=effect.ci_high)
    return out


def tables(board: pd.DataFrame) -> list[tuple[str, str, str, str, pd.DataFrame]]:
    """(model, protocol, length, cohort, rows) per table: never two protocols in one (their runs answer other
    questions of the cache); each model's protocols in turn, its lengths together first, then each length, each
    table followed by its runs with those catching up (``CATCHING_UP``) where some are."""
    board = board.assign(protocol=board["protocol"].fillna(""), cohort=board["cohort"].fillna(MAIN))
    order = board.assign(_parts=board["length"].str.count(r"\+"), _first=board["length"].str.split("+").str[0]
                         .astype(int), _inside=board["protocol"] != "question inside")
    keys = order.sort_values(["model", "_inside", "protocol", "_parts", "_first", "cohort"],
                             ascending=[True, True, True, False, True, True])[["model", "protocol", "length", "cohort"]]
    return [(model, protocol, length, cohort, board[(board["model"] == model) & (board["protocol"] == protocol)
                                                    & (board["length"] == length) & (board["cohort"] == cohort)])
            for model, protocol, length, cohort in keys.drop_duplicates().itertuples(index=False)]


def title(model: str, length: str, protocol: str = "", cohort: str = MAIN) -> str:
    lengths = length.split("+")
    tokens = f"{length} tokens" if len(lengths) == 1 else f"{', '.join(lengths[:-1])} and {lengths[-1]} tokens together"
    return ", ".join(filter(None, [model, tokens, protocol, cohort]))


def interval(r, key: str, signed: bool = False) -> str:
    """``r[key] [low, high]``, with * where a signed difference's interval excludes zero; - where there is none."""
    value, low, high = r[key], r[f"{key}_low" if key != "score" else "ci_low"], r[f"{key}_high" if key != "score" else "ci_high"]
    if pd.isna(value):
        return "-"
    form = "{:+.1f}" if signed else "{:.1f}"
    if pd.isna(low):
        return form.format(value)
    star = "*" if signed and (low > 0 or high < 0) else ""
    return f"{form.format(value)} [{form.format(low)}, {form.format(high)}]{star}"


def markdown(board: pd.DataFrame) -> list[str]:
    """One table per model and length (``tables``): the full cache first, then by budget and score; a table of
    follow-ups adds the first question's score and the follow-ups' difference to it (paired); a table whose budgets
    are shares of the prompt is also given as kvpress's leaderboard gives it (``by_ratio``)."""
    lines = []
    for model, protocol, length, cohort, block in tables(board):
        n = int(block["n"].max())
        follow = block["first"].notna().any()
        extra = " first question [95 %] | follow-ups - first [95 %] |" if follow else ""
        lines += [f"### {title(model, length, protocol, cohort)} ({n} samples per run)", "",
                  "| method | selection | budget | score [95 %] | KV kept | prefill | decode | perturbation - attention "
                  "[95 %] |" + extra, "|---|---|---:|---|---:|---:|---:|---|" + ("---|---|" if follow else "")]
        order = block.assign(_full=block["budget"].notna(), _budget=block["budget"].fillna(0))
        for _, r in order.sort_values(["_full", "_budget", "score"], ascending=[True, True, False]).iterrows():
            budget = "-" if pd.isna(r["budget"]) else f"{r['budget']:g}"
            costs = ["-" if pd.isna(r[c]) else f"{r[c]:.2f}x" for c in ("prefill_rel", "decode_rel")]
            lines.append(f"| {r['method']} | {r['selection']} | {budget} | {interval(r, 'score')} | "
                         f"{100 * r['kv_kept']:.1f} % | {costs[0]} | {costs[1]} | {interval(r, 'effect', True)} |"
                         + (f" {interval(r, 'first')} | {interval(r, 'loss', True)} |" if follow else ""))
        lines.append("")
        lines += by_ratio(block)
    return lines


def by_ratio(block: pd.DataFrame) -> list[str]:
    """A table of shares as kvpress's leaderboard reads: a row per method and selection, a column per compression
    ratio (1 - share), each cell its score [95 %]; nothing for a table of entry budgets or one share."""
    budgets = block["budget"].dropna()
    if budgets.empty or not all(0 < b < 1 for b in budgets) or budgets.nunique() < 2:   # shares lie in (0, 1)
        return []
    ratios = sorted({round(1 - b, 6) for b in budgets})
    full = block[block["budget"].isna()]
    lines = ["By compression ratio (kvpress's: the share of each prompt evicted)"
             + (f"; the full cache scores {interval(full.iloc[0], 'score')}" if not full.empty else "") + ":", "",
             "| method | selection | " + " | ".join(f"{r:g}" for r in ratios) + " |",
             "|---|---|" + "---|" * len(ratios)]
    compressed = block[block["budget"].notna()]
    groups = sorted(compressed.groupby(["method", "selection"], sort=False), key=lambda g: -g[1]["score"].mean())
    for (method, selection), rows in groups:      # best mean over the ratios first
        cells = {round(1 - r["budget"], 6): interval(r, "score") for _, r in rows.iterrows()}
        lines.append(f"| {method} | {selection} | " + " | ".join(cells.get(r, "-") for r in ratios) + " |")
    return lines + [""]
