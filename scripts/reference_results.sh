#!/usr/bin/env bash
# The committed reference results: a small sweep on the embedded model, then its report.
#   needle: full cache; snapkv and adakv x attention and perturbation x budgets 64, 128, 256
#   perturbation analysis: snapkv and adakv at budget 128
#   laprox: the needle test at budgets 64, 128, 256; the needle grid at about 5 % of the context for every
#   method (experiment laprox_embedded); the perturbation analysis of laprox beside the three methods
#   ruler: niah_single_1/2 at 2,048 tokens, snapkv and adakv x selections, the question inside the compressed
#   context at budgets 256, 512 (experiment ruler_embedded; 500 samples each, RULER's number) and fed after it at
#   1,024, 1,536 (ruler_embedded_question_after; 200 and 300): the longest part, about 5 h on 2 cores
# Finished runs are skipped, so the script can be rerun after an interruption (about 75 min on 2 CPU cores
# before runs shared their prefills).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RESULTS=${RESULTS:-results/embedded}
# One sweep for the needle runs (they share each sample's prefill), one for the analysis runs (one model load).
$PY run.py -m method=full,snapkv,adakv,laprox selection=attention,perturbation budget=64,128,256 \
  results_dir="$RESULTS" progress=false
$PY run.py -m benchmark=perturbation method=snapkv,adakv budget=128 results_dir="$RESULTS" progress=false
$PY run.py -m experiment=laprox_embedded results_dir="$RESULTS" progress=false
$PY run.py benchmark=perturbation method=snapkv budget=128 results_dir="$RESULTS" progress=false \
  "benchmark.selections=[attention,perturbation,pyramidkv/perturbation,adakv/perturbation,laprox]"
# The two RULER settings side by side, one thread each: on 2 cores, 1.5x the samples per hour of one process
# using both (6.8 against 4.4 samples a minute, measured here).
OMP_NUM_THREADS=1 $PY run.py -m experiment=ruler_embedded results_dir="$RESULTS" progress=false & inside=$!
OMP_NUM_THREADS=1 $PY run.py -m experiment=ruler_embedded_question_after results_dir="$RESULTS" progress=false & after=$!
wait $inside
wait $after
$PY -m pcs.report --results "$RESULTS" --out "$RESULTS/report"
