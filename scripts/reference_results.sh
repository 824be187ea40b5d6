#!/usr/bin/env bash
# The committed reference results: a small sweep on the embedded model, then its report.
#   needle: full cache; snapkv and adakv x attention and perturbation x budgets 64, 128, 256
#   perturbation analysis: snapkv and adakv at budget 128
#   laprox: the needle test at budgets 64, 128, 256; the needle grid at about 5 % of the context for every
#   method (experiment laprox_embedded); the perturbation analysis of laprox beside the three methods
# Finished runs are skipped, so the script can be rerun after an interruption (about 75 min on 2 CPU cores).
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
for budget in 64 128 256; do
  $PY run.py method=laprox budget=$budget results_dir="$RESULTS" progress=false
done
$PY run.py -m experiment=laprox_embedded results_dir="$RESULTS" progress=false
$PY run.py benchmark=perturbation method=snapkv budget=128 results_dir="$RESULTS" progress=false \
  "benchmark.selections=[attention,perturbation,pyramidkv/perturbation,adakv/perturbation,laprox]"
$PY -m pcs.report --results "$RESULTS" --out "$RESULTS/report"
