"""Measure what sharing each sample's prefill saves: one sweep run as one group (the default launcher) and
the same sweep one run at a time (Hydra's basic launcher, same process), timed; their predictions compared
field by field (timings aside). Writes results/bench/shared_prefill_<device>.json.

    .venv/bin/python scripts/shared_prefill.py            # snapkv, adakv x attention, perturbation x 64, 128
    .venv/bin/python scripts/shared_prefill.py method=snapkv budget=64,128 benchmark.context_lengths=[600]
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ["method=snapkv,adakv", "selection=attention,perturbation", "budget=64,128"]
TIMINGS = ("prefill_s", "decode_s")


def sweep(results: Path, launcher: str, overrides: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "run.py", "-m", *overrides, f"hydra/launcher={launcher}", "progress=false",
                    f"results_dir={results}", f"hydra.sweep.dir={results}/multirun"], cwd=ROOT, check=True)
    return time.perf_counter() - start


def predictions(results: Path) -> dict[str, list[dict]]:
    return {str(p.parent.relative_to(results)): [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
                                                for line in p.read_text().splitlines()]
            for p in sorted(results.rglob("predictions.jsonl"))}


def main(argv: list[str]) -> int:
    overrides = argv or SWEEP
    with tempfile.TemporaryDirectory() as tmp:
        shared, separate = Path(tmp) / "shared", Path(tmp) / "separate"
        shared_s = sweep(shared, "local", overrides)
        separate_s = sweep(separate, "basic", overrides)
        got, want = predictions(shared), predictions(separate)
    identical = got == want
    result = {"sweep": overrides, "runs": len(want), "samples": sum(len(rows) for rows in want.values()),
              "shared_s": round(shared_s, 1), "separate_s": round(separate_s, 1),
              "ratio": round(shared_s / separate_s, 3), "identical_predictions": identical,
              "differing_runs": sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))}
    print(json.dumps(result, indent=2))
    if not argv:
        (ROOT / "results/bench/shared_prefill_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
