#!/usr/bin/env bash
# The GPU check, for a CUDA machine with no internet: the GPU-only tests (pytest -m gpu) and the long-context
# bench (Llama-3.1-8B shapes, random bfloat16 weights, 8K-128K tokens, every method x selection at budgets 128
# and 1024, and preset=criticalkv with its attention baseline; the perturbation analysis at 32K).
#
#   make gpu-wheels            # beforehand, where a registry is reachable: wheels/ (git-ignored, < 64 MiB)
#   bash scripts/gpu_check.sh  # on the GPU machine, in the checkout, with wheels/ beside it
#
# wheels/ is git-ignored: a copy of the checkout has it only if it is carried (the device tool's carry: ["wheels"]).
# Results go to $OUT where it is set (what comes back from a lent machine), else to results/bench/:
# gpu_<device>.jsonl, gpu_<device>_analysis.jsonl and gpu_<device>_tests.log. Each row is written as soon as its
# last round is measured (a median over the rounds; the rounds before the last measure every configuration), so a
# command stopped at its time limit keeps the rows before it. Written to results/bench/, the
# table also goes into results/bench/README.md; rows brought back from $OUT get it here with
#   .venv/bin/python scripts/gpu_readme.py results/bench/gpu_<device>.jsonl
#
# Everything at once takes longer than a 10-minute command. In parts that fit (one H100 session's estimate, 2026-11;
# on an H200, 8K with 3 methods, both selections, 2 budgets and criticalkv did not finish in 140 s, and 32K's first
# 8 rows took 270 s with 2 rounds and 4 decoded tokens):
#   TESTS=1 CONTEXTS= bash scripts/gpu_check.sh                              # the tests alone, CUDA graphs first
#   TESTS=0 CONTEXTS=8192 POOLS= bash scripts/gpu_check.sh                   # issue 28's 8K rows
#   TESTS=0 APPEND=1 CONTEXTS=32768 METHODS="snapkv pyramidkv adakv" POOLS= REPEATS=2 bash scripts/gpu_check.sh
#   TESTS=0 APPEND=1 CONTEXTS=32768 METHODS=snapkv BUDGETS= PRESETS= ANALYSIS=1 bash scripts/gpu_check.sh
#   TESTS=0 APPEND=1 CONTEXTS=131072 METHODS=snapkv BUDGETS=128 PRESETS= POOLS= REPEATS=1 bash scripts/gpu_check.sh
# Issue 28's prefill ratios alone, in one 15-minute lease (decoding 2 tokens a row: the ratio reads the prefill). On an
# H200 (2026-11-26, fourth session) 8K's first 23 rows (3 methods, 2 budgets, criticalkv) took 190 s, 32K with
# METHODS=snapkv and criticalkv 9 rows about 110 s, and a machine's start about 30 s:
#   TESTS=0 CONTEXTS=8192 METHODS="snapkv pyramidkv adakv" POOLS= REPEATS=2 DECODE_TOKENS=2 bash scripts/gpu_check.sh
#   TESTS=0 APPEND=1 CONTEXTS=32768 METHODS="snapkv pyramidkv adakv" POOLS= REPEATS=2 DECODE_TOKENS=2 ANALYSIS=0 ...
# and the overlap's A/B in the same lease: TESTS=0 APPEND=1 CONTEXTS=8192 METHODS=snapkv PRESETS= BEHIND=0 (then 1) ...
# On an H200 (2026-11-27, eleventh session): all of tests/test_gpu.py 78 s (71 tests); 8K METHODS=adakv with
# criticalkv, REPEATS=3, 91 s; 32K METHODS=snapkv with criticalkv, REPEATS=2, 120 s; 32K METHODS="pyramidkv adakv"
# PRESETS=, REPEATS=2, 113 s; 8K METHODS="snapkv pyramidkv" with criticalkv, REPEATS=2, over 105 s (stopped there
# after 10 of its 17 rows); the machine's start and the transfers about 30 s.
# With 2 rounds one outlier round moves a row's median halfway: the report voids such pairs (a median more than 10 %
# above the row's fastest round; an attention row at 8K once took 0.339 s against 0.249-0.253 s). REPEATS=3 keeps
# the median off a single outlier, at half as much time again.
# An A/B against older code on the same machine: its checkout, carried, with hydra_plugins/ beside its pcs/ (the
# launcher plugin pcs's configs name): `git archive <commit> pcs hydra_plugins | tar -x -C .devtmp/base`, carry
# [".devtmp/base"], and run `python -m pcs.bench` from there.
# The norms kernel's A/B (8K, SnapKV and criticalkv, about 80 s each on an H200; its tests: -k value_norm_kernel and
# -k bounded_stage2, whose 6 cells run with and without it):
#   TESTS=0 APPEND=1 CONTEXTS=8192 METHODS=snapkv POOLS= REPEATS=2 DECODE_TOKENS=2 KERNEL=0 bash scripts/gpu_check.sh
#   (then without KERNEL=0)
# Stage 2's search, bounded against every entry scored (the default, auto, scores every entry below 16K entries a
# layer, and in longer ones once a run's bounded layers have left more than half their entries to score; on an
# H200, 2026-11-26, 8K with METHODS="snapkv adakv" and criticalkv, REPEATS=3, took about 200 s a search,
# 32K with METHODS=snapkv and criticalkv, REPEATS=2, about 120 s):
#   python3 -m pytest -q -m gpu tests/test_gpu.py -k "scoring_every or bounded_stage2 or syncs_a_constant"
#   TESTS=0 CONTEXTS=8192 METHODS=snapkv POOLS= REPEATS=3 DECODE_TOKENS=2 SEARCH=bounded bash scripts/gpu_check.sh
#   (then APPEND=1 ... SEARCH=exhaustive), and both at 32K: APPEND=1 CONTEXTS=32768 METHODS=snapkv ANALYSIS=0 ...
#   Where the threshold (pcs.eviction.scores.EXHAUSTIVE_BELOW_ENTRIES, 16K) belongs: the same pair at CONTEXTS=16384
#   (ninth session: bounded 1.013 against 1.081 at b128).
# The norms kernel's block shapes (26 s on an H200; writes results/bench/value_norm_blocks_<device>.jsonl or --out):
#   PYTHONPATH=/tmp/pcs-gpu-site:$PWD python3 scripts/value_norm_blocks.py --out "$OUT/value_norm_blocks.jsonl"
#   (after a gpu_check.sh run has installed wheels/ there)
# Knobs: CONTEXTS, METHODS (the full cache is always measured), BUDGETS, PRESETS, POOLS (decode pool sizes; empty:
# no pools), REPEATS, ANALYSIS (the 32K perturbation analysis; default: only when CONTEXTS holds 32768), TESTS,
# APPEND (add to the results file instead of starting it anew), EAGER=1 (pools without CUDA graphs), DECODE_TOKENS
# (tokens decoded per row and pool, 32), BEHIND (how many layers behind the forward each layer is compressed, on a
# stream of its own; 0: right after its forward, on the forward's stream: the A/B of the overlap; rows say which in
# compression_layers_behind, and the report pairs only rows compressed alike), KERNEL=0 (stage 2's exact norms from
# batched products instead of pcs.kernels.value_norms's one kernel, the default: the A/B of VALUE_NORM_KERNEL),
# SEARCH (auto, bounded or exhaustive: how stage 2 searches on the GPU, --stage2-search; auto by default), PROFILE=1 (also one profiled prefill per
# row into $DEST/profile/: the op tables and, per compressed layer, the kernels and device time of the operators
# inside the compression).
#
# The machine brings torch (CUDA) and transformers; what else pcs's engine needs (hydra-core, omegaconf,
# antlr4) is installed from wheels/ into a folder of its own, without touching the machine's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${PCS_GPU_SITE:-/tmp/pcs-gpu-site}
CONTEXTS=${CONTEXTS-8192 32768 131072}
REPEATS=${REPEATS:-3}
METHODS=${METHODS:-snapkv pyramidkv adakv streamingllm laprox}
BUDGETS=${BUDGETS-128 1024}
PRESETS=${PRESETS-criticalkv}
POOLS=${POOLS-1 8 32 64}
case " $CONTEXTS " in *" 32768 "*) ANALYSIS=${ANALYSIS:-1} ;; *) ANALYSIS=${ANALYSIS:-0} ;; esac
DEST=${OUT:-results/bench}
mkdir -p "$DEST"

if compgen -G "wheels/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" wheels/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

"$PY" - <<'PY'
import sys
try:
    import hydra, omegaconf  # noqa: F401
except ImportError as err:
    sys.exit(f"[gpu_check] {err}: pcs needs hydra-core and omegaconf; build wheels/ with `make gpu-wheels` where a "
             "registry is reachable and bring it along (the device tool: carry [\"wheels\"])")
import torch, transformers
if not torch.cuda.is_available():
    sys.exit("[gpu_check] no CUDA device: this script is for a GPU machine")
print(f"[gpu_check] {torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
DEVICE=$("$PY" -c "import torch, re; print(re.sub(r'[^A-Za-z0-9]+', '_', torch.cuda.get_device_name(0)).strip('_'))")
OUT_FILE=$DEST/gpu_${DEVICE}.jsonl
EAGER=${EAGER:-0}

tests_rc=0   # a failing test does not stop the bench; the script exits with the tests' status at the end
if [ "${TESTS:-1}" != 0 ]; then
  LOG=$DEST/gpu_${DEVICE}_tests.log
  # the CUDA-graph test first: if capture fails there, the pools below decode eagerly instead of failing late
  if ! "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k cuda_graph 2>&1 | tee "$LOG"; then
    tests_rc=1 EAGER=1
    echo "[gpu_check] the CUDA-graph test failed: pools decode without graphs (EAGER=1)"
  fi
  "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "not cuda_graph" 2>&1 | tee -a "$LOG" \
    || tests_rc=1
fi

bench_args=(--model llama31-shape --layers 32 --device cuda --methods $METHODS --selections attention perturbation
            --repeats "$REPEATS" --decode-tokens "${DECODE_TOKENS:-32}" --json)
[ -z "$BUDGETS" ] || bench_args+=(--budgets $BUDGETS)
[ -z "$PRESETS" ] || bench_args+=(--presets $PRESETS)
[ -z "$POOLS" ] || bench_args+=(--pools $POOLS)
[ "$EAGER" = 0 ] || bench_args+=(--eager)
[ -z "${BEHIND:-}" ] || bench_args+=(--layers-behind "$BEHIND")
case "${KERNEL:-}" in 0) bench_args+=(--no-value-norm-kernel) ;; 1) bench_args+=(--value-norm-kernel) ;; esac
[ -z "${SEARCH:-}" ] || bench_args+=(--stage2-search "$SEARCH")
[ "${PROFILE:-0}" = 0 ] || bench_args+=(--profile "$DEST/profile")

[ "${APPEND:-0}" = 1 ] || [ -z "$CONTEXTS" ] || : > "$OUT_FILE"
for context in $CONTEXTS; do   # one process per context: each context's rows land as soon as they are measured
  "$PY" -m pcs.bench --contexts "$context" "${bench_args[@]}" | tee -a "$OUT_FILE"
done
[ "$ANALYSIS" = 0 ] || "$PY" -m pcs.bench --perturbation-analysis --model llama31-shape --layers 32 \
    --contexts 32768 --device cuda --methods snapkv --selections attention perturbation --budgets 128 1024 \
    --json | tee "${OUT_FILE%.jsonl}_analysis.jsonl"

if [ -n "$CONTEXTS" ] && [ "$DEST" = results/bench ]; then
  "$PY" scripts/gpu_readme.py "$OUT_FILE"
  echo "[gpu_check] wrote $OUT_FILE and its table in results/bench/README.md"
elif [ -n "$CONTEXTS" ]; then
  "$PY" -m pcs.bench --report "$OUT_FILE"
  echo "[gpu_check] wrote $OUT_FILE: copy it to results/bench/ and run scripts/gpu_readme.py on it there"
fi
exit "$tests_rc"
