#!/usr/bin/env bash
# The GPU check, for a CUDA machine with no internet: the GPU-only tests (pytest -m gpu) and the long-context
# bench (Llama-3.1-8B shapes, random bfloat16 weights, 8K-128K tokens, every method x selection at budgets 128
# and 1024, and preset=criticalkv with its attention baseline; the perturbation analysis at 32K), written to results/bench/gpu_<device>.jsonl (and
# gpu_<device>_analysis.jsonl) with its table and targets in results/bench/README.md.
#
#   make gpu-wheels            # beforehand, where a registry is reachable: wheels/ (git-ignored, < 64 MiB)
#   bash scripts/gpu_check.sh  # on the GPU machine, in the checkout (wheels/ travels with it)
#
# On an H100 the whole check takes longer than some job limits; it can go in parts, each a context:
#   CONTEXTS=8192 bash scripts/gpu_check.sh                     # the tests, then the bench at 8K
#   TESTS=0 APPEND=1 CONTEXTS=32768 bash scripts/gpu_check.sh  # adds 32K to the same results file
#   TESTS=0 APPEND=1 ANALYSIS=0 REPEATS=1 CONTEXTS=131072 bash scripts/gpu_check.sh
# METHODS narrows the methods (default: all five; the full cache is always measured).
#
# The machine brings torch (CUDA) and transformers; what else pcs's engine needs (hydra-core, omegaconf,
# antlr4) is installed from wheels/ into a folder of its own, without touching the machine's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${PCS_GPU_SITE:-/tmp/pcs-gpu-site}
CONTEXTS=${CONTEXTS:-8192 32768 131072}
REPEATS=${REPEATS:-3}
METHODS=${METHODS:-snapkv pyramidkv adakv streamingllm laprox}

if compgen -G "wheels/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" wheels/*.whl
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

"$PY" - <<'PY'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
print(f"[gpu_check] {torch.cuda.get_device_name(0)}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
DEVICE=$("$PY" -c "import torch, re; print(re.sub(r'[^A-Za-z0-9]+', '_', torch.cuda.get_device_name(0)).strip('_'))")
OUT_FILE=results/bench/gpu_${DEVICE}.jsonl

tests_rc=0   # a failing test does not stop the bench; the script exits with the tests' status at the end
[ "${TESTS:-1}" = 0 ] || "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider || tests_rc=$?

[ "${APPEND:-0}" = 1 ] || : > "$OUT_FILE"
for context in $CONTEXTS; do   # one process per context: each context's rows land as soon as they are measured
  "$PY" -m pcs.bench --model llama31-shape --layers 32 --contexts "$context" --device cuda \
      --methods $METHODS --selections attention perturbation --budgets 128 1024 --presets criticalkv \
      --repeats "$REPEATS" --decode-tokens 32 --pools 1 8 32 64 --json | tee -a "$OUT_FILE"
done
[ "${ANALYSIS:-1}" = 0 ] || "$PY" -m pcs.bench --perturbation-analysis --model llama31-shape --layers 32 \
    --contexts 32768 --device cuda --methods snapkv --selections attention perturbation --budgets 128 1024 \
    --json | tee "${OUT_FILE%.jsonl}_analysis.jsonl"

"$PY" - "$OUT_FILE" "$DEVICE" <<'PY'
import re, subprocess, sys
from pathlib import Path
path, device = sys.argv[1], sys.argv[2]
report = subprocess.run([sys.executable, "-m", "pcs.bench", "--report", path], check=True, capture_output=True,
                        text=True).stdout
readme = Path("results/bench/README.md")
begin, end = f"<!-- gpu {device} -->", f"<!-- /gpu {device} -->"
section = (f"{begin}\n## {Path(path).name}: Llama-3.1-8B shapes on {device.replace('_', ' ')}\n\n"
           f"Written by `bash scripts/gpu_check.sh` (random bfloat16 weights, 32 layers; medians over each row's `repeats` rounds).\n\n"
           f"{report}\n{end}")
text = readme.read_text()
text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda m: section, text, flags=re.S) if begin in text \
    else text.rstrip("\n") + "\n\n" + section + "\n"
readme.write_text(text)
print(report)
PY
echo "[gpu_check] wrote $OUT_FILE and its table in results/bench/README.md"
exit "$tests_rc"
