"""Print one line per finished run under a results folder: score, samples, KV kept, time.

    python scripts/summarize.py [results]
"""
import json
import sys
from pathlib import Path


def main(root: str = "results") -> None:
    runs = sorted(Path(root).rglob("metrics.json"))
    if not runs:
        print(f"no finished runs under {root}")
        return
    print(f"{'run':<60} {'score':>7} {'n':>4} {'KV kept':>8} {'time s':>8}")
    for path in runs:
        m = json.loads(path.read_text())
        kept = 100 * m["kv_cache_bytes"] / m["kv_cache_bytes_full"]
        name = str(path.parent.relative_to(root))
        score = "-" if m["score"] is None else f"{m['score']:.2f}"   # e.g. AlpacaEval not judged yet
        print(f"{name:<60} {score:>7} {m['n_samples']:>4} {kept:>7.1f}% {m['wall_time_s']:>8.1f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
