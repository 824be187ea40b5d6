"""Rescore run folders from their saved predictions, without loading a model.

    python -m pcs.rescore results/longbench                     # print every run's scores
    python -m pcs.rescore RUN_DIR --fuzzy-backend levenshtein   # what the other matcher gives
    python -m pcs.rescore RUN_DIR --write                       # rewrite scores in place

Each ``predictions.jsonl`` row carries what its metric needs (references, class list, task), and
``config.yaml`` the benchmark settings, so the scores can be recomputed anywhere.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


from .benchmarks.base import build_benchmark
from .run_folder import load_config, read_rows, write_json_atomic, write_rows_atomic
from .cli import command


def run_dirs(path: Path) -> list[Path]:
    """``path`` itself if it is a run folder, else every run folder below it."""
    found = sorted(p.parent for p in Path(path).rglob("predictions.jsonl") if (p.parent / "config.yaml").exists())
    if not found:
        raise FileNotFoundError(f"no run folder (config.yaml + predictions.jsonl) under {path}")
    return found


def rescore(run_dir: Path, fuzzy_backend: str | None = None) -> tuple[list[dict], dict]:
    """Rows with recomputed ``score`` and the benchmark's metrics for them."""
    cfg = load_config(run_dir)
    if fuzzy_backend is not None:
        cfg.benchmark.fuzzy_backend = fuzzy_backend
    benchmark = build_benchmark(cfg)
    rows = read_rows(run_dir / "predictions.jsonl")
    if not rows:
        raise ValueError(f"{run_dir} has no predictions yet")
    rows = [benchmark.scored(row) for row in rows]
    return rows, benchmark.metrics(rows)


def write(run_dir: Path, rows: list[dict], scores: dict) -> None:
    """Replace the rows' scores and the score fields of ``metrics.json`` (kept: sizes, times)."""
    write_rows_atomic(run_dir / "predictions.jsonl", rows)
    metrics_file = run_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {"n_samples": len(rows)}
    metrics.update(scores)
    write_json_atomic(metrics_file, metrics)


def main(argv: list[str] | None = None) -> int:
    parser = command("pcs.rescore", __doc__)
    parser.add_argument("paths", nargs="+", type=Path, help="run folders or folders holding them")
    parser.add_argument("--fuzzy-backend", choices=("difflib", "levenshtein"),
                        help="LongBench code tasks: score with this fuzz.ratio matcher instead of the run's")
    parser.add_argument("--write", action="store_true", help="rewrite predictions.jsonl scores and metrics.json")
    args = parser.parse_args(argv)
    if args.write and args.fuzzy_backend:
        parser.error("--write keeps each run's configured backend; use --fuzzy-backend without --write")
    for path in args.paths:
        for run_dir in run_dirs(path):
            rows, scores = rescore(run_dir, args.fuzzy_backend)
            if args.write:
                write(run_dir, rows, scores)
            detail = {k: scores[k] for k in ("tasks", "domains") if k in scores}
            print(f"{run_dir}  score {scores['score']:.2f}  ({len(rows)} samples)"
                  + (f"\n  {json.dumps(detail)}" if detail else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
