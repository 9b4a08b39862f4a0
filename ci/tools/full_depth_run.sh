#!/usr/bin/env bash
# One device call for the stored formats at full depth: the quantised-kernel GPU tests, the engine
# parity figures on tiny-fp8 / tiny-nvfp4, then the 48-layer in-memory bench in each format given
# (default "nvfp4 fp8"). Every step has its own time limit so the call ends inside the device limit.
# Env: OUT (results), FORMATS, STEP_S (per-format limit, default 165).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
free -g | head -2
[ -n "${SKIP_TESTS:-}" ] || timeout 100 python3 -m pytest -p no:cacheprovider -q -rfE -m gpu tests/engine/test_quant_linear.py \
  -o addopts="" >"$OUT/quant_tests.log" 2>&1; echo "quant GPU tests rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "passed|failed|^FAILED|^E " "$OUT/quant_tests.log" | head -n 30
[ -n "${SKIP_TESTS:-}" ] || timeout 80 python3 - >"$OUT/parity.json" 2>"$OUT/parity.err" <<'PY'
import json
from engine.selfcheck import fixture_figures
print(json.dumps({n: fixture_figures(n, "cuda") for n in ("tiny-fp8", "tiny-nvfp4")}, default=str, indent=1))
PY
echo "selfcheck rc=$? ($(( $(date +%s) - t0 )) s)"; cat "$OUT/parity.json"; tail -n 5 "$OUT/parity.err"
for w in ${FORMATS:-nvfp4 fp8}; do
  t1=$(date +%s)
  timeout $(( ${STEP_S:-165} + 10 )) python3 -m parity.cli bench --synthetic real-widths --backend engine \
    --device cuda --layers 48 --weights "$w" --prompt-lens 512,4096 --batches 1,16 --contexts 1024 --repeats 3 \
    --warmup 1 --decode-tokens 8 --no-extras --budget-s $(( ${STEP_S:-165} - 70 )) --timeout-s "${STEP_S:-165}" \
    --overwrite --out "$OUT/bench-full-$w.json" 2>&1 | grep -vE "it/s\]|s/it\]" >"$OUT/bench-full-$w.log"
  echo "bench $w rc=${PIPESTATUS[0]} ($(( $(date +%s) - t1 )) s)"; tail -n 45 "$OUT/bench-full-$w.log"
done
echo "total $(( $(date +%s) - t0 )) s"
