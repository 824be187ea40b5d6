"""Check engine.stop_when_scored against answers decoded in full: for every answer of the given RULER run folders
(decoded without the knob), re-tokenize it and find the first prefix the benchmark calls settled; that answer's
whole score must be 100, or the early stop would have changed it. Also reports the share of tokens the knob
would have saved (answers stop at the next multiple of pcs.engine.decode.SETTLE_EVERY tokens).

    python scripts/check_stop_when_scored.py results/embedded/ruler/gemma3_270m/*/

Exits 1 on an answer whose early stop would have changed its score. Only the run folders' configs, the model's
tokenizer and RULER's scoring are used (no model weights).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from pcs.benchmarks.base import Sample, build_benchmark
from pcs.engine.decode import SETTLE_EVERY
from pcs.models import weights_location
from pcs.run_folder import is_finished, load_config


def decoded_in_full(run: Path) -> bool:
    """Whether the run's answers were decoded without the knob. A finished run records how its job decoded
    (metrics.json's ``engine``; runs from before the knob record none or no ``stop_when_scored``); the run's
    config does not (the engine is not part of a run's identity), so an unfinished run is skipped. A grown run
    counts as its finishing job says (answers it took from another run were decoded as that run's were)."""
    if not is_finished(run):
        print(f"skipped (unfinished: how its answers were decoded is recorded when it finishes): {run}")
        return False
    if (json.loads((run / "metrics.json").read_text()).get("engine") or {}).get("stop_when_scored"):
        print(f"skipped (already stopped when scored): {run}")
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    tokenizers, wrong = {}, []
    tally = {}          # model -> [answers, would stop early, tokens decoded, tokens the knob would have decoded]
    for run in args.runs:
        if not decoded_in_full(run):
            continue
        cfg = load_config(run)
        benchmark = build_benchmark(cfg)
        name = cfg.model.name
        if name not in tokenizers:
            tokenizers[name] = AutoTokenizer.from_pretrained(weights_location(cfg.model))
        tokenizer = tokenizers[name]
        counts = tally.setdefault(name, [0, 0, 0, 0])
        for line in (run / "predictions.jsonl").read_text().splitlines():
            row = json.loads(line)
            settled = benchmark.settled(Sample(id=row["id"], prompt="", max_new_tokens=0, meta=row))
            ids = tokenizer.encode(row["prediction"], add_special_tokens=False)
            stop = next((t for t in range(SETTLE_EVERY, len(ids) + 1, SETTLE_EVERY)
                         if settled(tokenizer.decode(ids[:t], skip_special_tokens=True))), None)
            early = stop is not None and stop < row["new_tokens"]
            counts[0] += 1
            counts[1] += early
            counts[2] += row["new_tokens"]
            counts[3] += row["new_tokens"] if stop is None else min(stop, row["new_tokens"])
            if early and row["score"] != 100.0:
                wrong.append(f"{run.name} {row['id']}: settled after {stop} tokens, scored {row['score']} whole")
    for name, (answers, early, decoded, needed) in sorted(tally.items()):
        print(f"{name}: {answers} answers; {early} would stop early; tokens {needed} of {decoded} "
              f"({needed / max(decoded, 1):.0%})")
    print(f"{len(wrong)} answers that would stop early score below 100 whole")
    for line in wrong:
        print("  " + line)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
