#!/usr/bin/env bash
# The GPU check, for a CUDA machine without internet: the GPU-only tests (pytest -m gpu, the CUDA-graph test first)
# and the long-context bench (python -m pcs.bench on Llama-3.1-8B shapes, random bfloat16 weights, 32 layers: every
# method x selection at budgets 128 and 1024, preset=criticalkv with its attention baseline, decode pools, and the
# perturbation analysis at 32K). The tables it gives, and what they show: results/bench/README.md.
#
#   make gpu-wheels            # beforehand, where a registry is reachable: wheels/ (git-ignored, < 64 MiB)
#   bash scripts/gpu_check.sh  # on the GPU machine, in the checkout, with wheels/ beside it
#
# wheels/ is git-ignored: a copy of the checkout has it only if it is carried (the device tool's carry: ["wheels"]).
# The machine brings torch (CUDA) and transformers; what else pcs's engine needs (hydra-core, omegaconf, antlr4) is
# installed from wheels/ into a folder of its own, without touching the machine's packages.
#
# Results go to $OUT where it is set (what comes back from a lent machine), else to results/bench/:
# gpu_<device>.jsonl, gpu_<device>_analysis.jsonl and gpu_<device>_tests.log. Each row is written as soon as its
# last round is measured, so a command stopped at its time limit keeps the rows before it. Written to
# results/bench/, the table also goes into results/bench/README.md; rows brought back from $OUT get it there with
#   .venv/bin/python scripts/gpu_readme.py results/bench/gpu_<device>.jsonl
#
# Everything at once (the defaults: 8K, 32K and 128K, five methods, pools of 1 to 64, 32 decoded tokens a row) takes
# longer than a 10-minute command. In parts, with what each took on an H200 (a machine's start and the transfers add
# about 30 s; 2 decoded tokens a row, so read only the prefill columns):
#   DECODE=1 TESTS=graphs bash scripts/gpu_check.sh                   # decoding against its bound (below): first
#   TESTS=1 CONTEXTS= bash scripts/gpu_check.sh                       # every GPU test (71): about 80 s
#   TESTS=0 CONTEXTS=8192 METHODS=adakv POOLS= REPEATS=3 DECODE_TOKENS=2 bash scripts/gpu_check.sh              # 91 s
#   TESTS=0 APPEND=1 CONTEXTS=8192 METHODS="snapkv pyramidkv" POOLS= REPEATS=2 DECODE_TOKENS=2 bash ...
#       # more than 105 s: stopped there after 10 of its 17 rows
#   TESTS=0 APPEND=1 CONTEXTS=32768 METHODS=snapkv POOLS= REPEATS=2 DECODE_TOKENS=2 ANALYSIS=0 bash ...        # 120 s
#   TESTS=0 APPEND=1 CONTEXTS=32768 METHODS="pyramidkv adakv" PRESETS= POOLS= REPEATS=2 DECODE_TOKENS=2 \
#       ANALYSIS=0 bash scripts/gpu_check.sh                                                                  # 113 s
# Not timed on the present code: the perturbation analysis at 32K (TESTS=0 CONTEXTS= ANALYSIS=1 ...; its own GPU work is
# about 4 s), 128K (CONTEXTS=131072 METHODS=snapkv BUDGETS=128 PRESETS= REPEATS=1 ...) and the decode pools (POOLS).
# With 2 rounds one outlier round moves a row's median halfway: the report voids such a pair (a median more than 10 %
# above the row's fastest round); REPEATS=3 keeps the median off a single outlier, at half as much time again.
#
# A/B runs: BEHIND=0 (compress right after each layer's forward) against the default 2 layers behind; KERNEL=0 (the
# exact norms from batched products) against the norms kernel; SEARCH=bounded against SEARCH=exhaustive (the default,
# auto, scores every entry in layers of fewer than 16K entries, and in longer ones once a run's bounded layers have
# left more than half their entries to score). Against older code on the same machine: carry its checkout with
# hydra_plugins/ beside its pcs/ (`git archive <commit> pcs hydra_plugins | tar -x -C .devtmp/base`, carry
# [".devtmp/base"]) and run `python -m pcs.bench` from there.
#
# DECODE=1: the decode measurement alone, first whenever a GPU is at hand (Llama-3.1-8B shapes, 32 layers: at
# DECODE_CONTEXTS, 8K and 32K, the full cache, SnapKV and AdaKV at budgets 128 and 1024, pools of 1, 8 and 64 and a
# mixed pool, with and without CUDA graphs, DECODE_TOKENS=16 timed steps each, every row against its bound; the
# device's copy bandwidth measured in the same process; rows as the engine runs by default (the decode kernel, the
# compiled step), and at UNCOMPILED_CONTEXTS, 8K, with the step uncompiled too, and at MASKED_CONTEXTS, none by
# default, through masked attention, for comparisons on the same machine). TESTS=graphs runs the decode tests
# first: the CUDA-graph tests, the kernel's, and pooled decoding through the kernel against batch 1 (compiled steps,
# their kernels counted); if those fail the bench times uncompiled steps. Before the step was compiled it took 264 s
# on an H200 (the table: results/bench/README.md, "GPU: decoding against its bound").
#
# Knobs: CONTEXTS, METHODS (the full cache is always measured), BUDGETS, PRESETS, POOLS (decode pool sizes; empty:
# no pools), REPEATS, ANALYSIS (the 32K perturbation analysis; default: only when CONTEXTS holds 32768), TESTS,
# APPEND (add to the results file instead of starting it anew), EAGER=1 (pools without CUDA graphs), DECODE_TOKENS
# (tokens decoded per row and pool, 32), BEHIND (layers behind the forward each layer is compressed, on a stream of
# its own; rows record it in compression_layers_behind, and the report pairs only rows compressed alike), KERNEL
# (0: batched products, 1: the norms kernel of pcs.kernels.value_norms, the default on CUDA), SEARCH (auto, bounded
# or exhaustive: --stage2-search), PROFILE=1 (also one profiled prefill per row into $DEST/profile/: the op tables
# and, per compressed layer, the kernels and device time of the operators inside the compression).
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
if [ "${TESTS:-1}" = graphs ]; then          # the decode tests alone (DECODE=1's check before it times)
  LOG=$DEST/gpu_${DEVICE}_tests.log
  if ! "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k cuda_graph 2>&1 | tee "$LOG"; then
    tests_rc=1 EAGER=1
    echo "[gpu_check] the CUDA-graph test failed: pools decode without graphs (EAGER=1)"
  fi
  "$PY" -m pytest -q tests/test_decode_attention.py -p no:cacheprovider 2>&1 | tee -a "$LOG" || tests_rc=1
  if ! "$PY" -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider -k through_the_kernel 2>&1 \
      | tee -a "$LOG"; then
    tests_rc=1 COMPILED=0
    echo "[gpu_check] pooled decoding through the compiled step failed: pools decode uncompiled (--no-compile-step)"
  fi
elif [ "${TESTS:-1}" != 0 ]; then
  LOG=$DEST/gpu_${DEVICE}_tests.log
  # the CUDA-graph test first: if capture fails there, the pools below decode eagerly instead of failing late
  if ! "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k cuda_graph 2>&1 | tee "$LOG"; then
    tests_rc=1 EAGER=1
    echo "[gpu_check] the CUDA-graph test failed: pools decode without graphs (EAGER=1)"
  fi
  "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "not cuda_graph" 2>&1 | tee -a "$LOG" \
    || tests_rc=1
fi

if [ "${DECODE:-0}" = 1 ]; then
  # Decoding first, in one command of at most 6 minutes: the CUDA-graph test (a failed capture decodes eagerly),
  # then every decode configuration against its bound (pcs/bench/decode.py), rows to gpu_<device>_decode.jsonl.
  DECODE_FILE=$DEST/gpu_${DEVICE}_decode.jsonl
  [ "${APPEND:-0}" = 1 ] || : > "$DECODE_FILE"
  decode_args=(--decode --model llama31-shape --layers 32 --device cuda --methods snapkv adakv --budgets 128 1024
               --pools 1 8 64 --decode-tokens "${DECODE_TOKENS:-16}" --json)
  [ "$EAGER" = 0 ] || decode_args+=(--eager)
  [ "${COMPILED:-1}" = 1 ] || decode_args+=(--no-compile-step)
  for context in ${DECODE_CONTEXTS:-8192 32768}; do
    "$PY" -m pcs.bench --contexts "$context" "${decode_args[@]}" | tee -a "$DECODE_FILE"
  done
  for context in ${UNCOMPILED_CONTEXTS-8192}; do    # the uncompiled step beside it, on the same machine
    [ "${COMPILED:-1}" = 1 ] || break
    "$PY" -m pcs.bench --contexts "$context" "${decode_args[@]}" --no-compile-step | tee -a "$DECODE_FILE"
  done
  for context in ${MASKED_CONTEXTS-}; do    # the masked attention beside it, on the same machine
    "$PY" -m pcs.bench --contexts "$context" "${decode_args[@]}" --no-decode-kernel | tee -a "$DECODE_FILE"
  done
  "$PY" -m pcs.bench --report "$DECODE_FILE"
  exit "$tests_rc"
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
