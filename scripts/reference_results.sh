#!/usr/bin/env bash
# The committed reference results: a small sweep on the embedded model, then its report.
#   needle: full cache; snapkv and adakv x attention and perturbation x budgets 64, 128, 256
#   perturbation analysis: snapkv and adakv at budget 128
# Finished runs are skipped, so the script can be rerun after an interruption (about 30 min on 2 CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RESULTS=${RESULTS:-results/embedded}
$PY run.py method=full results_dir="$RESULTS" progress=false
for method in snapkv adakv; do
  for budget in 64 128 256; do
    for selection in attention perturbation; do
      $PY run.py method=$method selection=$selection budget=$budget results_dir="$RESULTS" progress=false
    done
  done
  $PY run.py benchmark=perturbation method=$method budget=128 results_dir="$RESULTS" progress=false
done
$PY -m pcs.report --results "$RESULTS" --out "$RESULTS/report"
