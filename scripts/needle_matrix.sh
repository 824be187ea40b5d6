#!/usr/bin/env bash
# The needle test for every method x selection at budgets 64 and 128 on the embedded model,
# then a summary. Finished cells are skipped, so the script can be rerun after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RESULTS=${RESULTS:-results}
$PY run.py method=full results_dir="$RESULTS"
for budget in 64 128; do
  $PY run.py method=streamingllm budget=$budget results_dir="$RESULTS"
  for method in snapkv pyramidkv adakv; do
    for selection in attention perturbation; do
      $PY run.py method=$method selection=$selection budget=$budget results_dir="$RESULTS"
    done
  done
done
$PY scripts/summarize.py "$RESULTS"
