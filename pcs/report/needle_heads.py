"""The needle-heads analysis (``python -m pcs.needle_heads``) related: the retrieval heads, and what each run kept of
the needle in them on the answers it got right and on those it lost. Reads the analysis' JSON only."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

TOP_HEADS = 10          # query heads counted as retrieval heads, at most
MIN_MASS = 0.1          # and only those that put at least this share of their attention on the needle's value:
                        # a model with few compressed heads (Gemma 3 270M: 12) would otherwise count heads that
                        # barely look at it
ANALYSIS_GLOB = "needle_heads*.json"


def analyses(results: Path) -> list[Path]:
    """The analysis files under a results folder."""
    return sorted(Path(results).rglob(ANALYSIS_GLOB))


def nanmean(values) -> np.ndarray:
    """The mean over the first axis, NaN where every value is (a sliding-window layer, a layer kept whole)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.array(values, dtype=float), axis=0)


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def top_heads(analysis: dict, top: int = TOP_HEADS, floor: float = MIN_MASS) -> list[tuple[int, int]]:
    """(layer, query head) of the highest mean retrieval mass over the samples the full cache answers right, at
    most ``top`` of them and none below ``floor``."""
    right = [np.array(s["retrieval"], dtype=float) for s in analysis["samples"] if s["full_score"] == 100]
    if not right:
        return []
    mean = nanmean(right)
    order = np.argsort(np.where(np.isnan(mean), -np.inf, mean), axis=None)[::-1]
    return [tuple(int(i) for i in np.unravel_index(k, mean.shape)) for k in order[:top] if mean.flat[k] >= floor]


def needle_kept(kept: list, heads: list[tuple[int, int]], n_query_heads: int) -> float:
    """Mean share of the needle kept over the KV heads (or query heads, where they choose apart) of ``heads``."""
    shares = []
    for layer, head in heads:
        per_head = kept[layer]
        if per_head is None:
            shares.append(1.0)
            continue
        shares.append(per_head[head // (n_query_heads // len(per_head))])
    return float(np.mean(shares)) if shares else float("nan")


def summary(analysis: dict, top: int = TOP_HEADS) -> dict:
    """Retrieval heads, and per run: its answers right (score 100) and lost, on the samples the full cache answers
    right, and the mean share of the needle's value kept in the retrieval heads and in every compressed head, for
    each; and of its key sentence in the retrieval heads (None for an analysis written before key tokens were
    measured)."""
    heads = top_heads(analysis, top)
    n_q = analysis["n_query_heads"]
    out = {"retrieval_heads": heads, "runs": {}}
    for run in analysis["runs"]:
        buckets: dict[str, list[tuple]] = {"right": [], "lost": []}
        for s in analysis["samples"]:
            if s["full_score"] != 100:
                continue
            got = s["runs"][run]
            kept = got["kept"]
            every = [(l, h) for l, layer in enumerate(kept) if layer is not None for h in range(n_q)]
            key = needle_kept(got["kept_key"], heads, n_q) if "kept_key" in got else None
            bucket = "right" if got["score"] == 100 else "lost"
            buckets[bucket].append((needle_kept(kept, heads, n_q), needle_kept(kept, every, n_q), key))

        def mean(values):
            values = [v for v in values if v is not None]
            return float(np.mean(values)) if values else None
        out["runs"][run] = {
            "label": analysis["labels"][run],
            **{f"n_{b}": len(v) for b, v in buckets.items()},
            **{f"kept_retrieval_{b}": mean([x[0] for x in v]) for b, v in buckets.items()},
            **{f"kept_all_{b}": mean([x[1] for x in v]) for b, v in buckets.items()},
            **{f"key_retrieval_{b}": mean([x[2] for x in v]) for b, v in buckets.items()}}
    return out




def mean_kept(analysis: dict, run: str) -> np.ndarray:
    """(layers, heads) mean share of the needle a run keeps over the samples the full cache answers right (NaN: a
    layer it keeps whole, or a sliding-window layer)."""
    grids = []
    for s in analysis["samples"]:
        if s["full_score"] != 100:
            continue
        kept = s["runs"][run]["kept"]
        width = max(len(layer) for layer in kept if layer is not None)
        grids.append([[np.nan] * width if layer is None else layer for layer in kept])
    return nanmean(grids) if grids else np.empty((0, 0))


def mean_retrieval(analysis: dict) -> np.ndarray:
    right = [s["retrieval"] for s in analysis["samples"] if s["full_score"] == 100]
    return nanmean(right) if right else np.empty((0, 0))


def markdown(analysis: dict, name: str) -> list[str]:
    """The summary as a table: per run, answers right and lost and what it kept of the needle in each case."""
    got = summary(analysis)
    right = sum(s["full_score"] == 100 for s in analysis["samples"])
    lines = [f"### {name}", "",
             f"{len(analysis['samples'])} samples, {right} answered right by the full cache (the rows count those). "
             f"Retrieval heads (layer, query head; at most {TOP_HEADS}, each with at least {MIN_MASS:.0%} of its attention "
             f"on the needle's value while the full cache answers), highest first: "
             + ", ".join(f"({l}, {h})" for l, h in got["retrieval_heads"]) + ".", "",
             "| run | right | lost | needle's value kept in retrieval heads: right / lost | in every compressed head: "
             "right / lost | its key sentence in retrieval heads: right / lost |",
             "|---|---:|---:|---|---|---|"]

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f} %"
    for run, r in got["runs"].items():
        lines.append(f"| {r['label']} | {r['n_right']} | {r['n_lost']} | {pct(r['kept_retrieval_right'])} / "
                     f"{pct(r['kept_retrieval_lost'])} | {pct(r['kept_all_right'])} / {pct(r['kept_all_lost'])} | "
                     f"{pct(r['key_retrieval_right'])} / {pct(r['key_retrieval_lost'])} |")
    return lines + [""]
