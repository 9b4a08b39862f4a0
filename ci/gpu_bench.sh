#!/usr/bin/env bash
# GPU generation tests + the engine benchmark at real widths, against the official implementation.
# Called by ci/gpu on the GPU machine, from the repository root. Budget: about 4 minutes of GPU time.
#
# The official peer needs transformers >= 5.23 (qwen4_exp): ci/gpu_env.sh installs it from .whl/.
# Environment: OUT (results folder; default ci/out), BENCH_BUDGET_S (measuring time per process before
# later settings are skipped, default 40), BENCH_TIMEOUT_S (hard limit per process, load included,
# default 150; what was measured before it is kept),
# BENCH_LAYERS (default 4 = one period: 3 GDN + 1 QSA, PLE on layer 1), BENCH_ARGS (extra bench flags),
# FULL_DEPTH (default 1: after the one-period bench, the real 48 layers with in-memory weights in each format
# FULL_DEPTH_FORMATS (default "nvfp4 fp8 bf16"): experts built on the device, no files; the FP8 PLE table at
# its real size in host memory; a format that does not fit (bf16, ~250 GB) is measured at 4 and 8 layers and
# projected; about 1-2 minutes each), FULL_DEPTH_TIMEOUT_S (per format, default 300),
# LLAMACPP (step 5, llama.cpp as the peer: runs when .llama-src/llama.cpp-src.tar.xz is there; LLAMACPP=0 skips).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-ci/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
status=0

. ci/gpu_env.sh  # the official implementation (transformers >= 5.23 wheel from .whl/)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY' || true
import importlib
for m in ("torch", "transformers", "cupy", "numba", "tokenizers", "jinja2"):
    try:
        mod = importlib.import_module(m); print(f"gpu_bench: {m} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"gpu_bench: {m} missing ({e})")
PY

# synthetic weights (~23.5 GB at 4 layers) go to RAM-backed /dev/shm when it has room: disk writes
# would dominate the run
need=$(( 30 * 1024 * 1024 ))
if [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2{print $4}')" -gt "$need" ] 2>/dev/null; then
  export QWEN4EXP_CACHE=/dev/shm/qwen4exp
else
  export QWEN4EXP_CACHE="${QWEN4EXP_CACHE:-/tmp/qwen4exp}"
fi
echo "gpu_bench: synthetic cache $QWEN4EXP_CACHE"

# 1. generation tests (GPU ones included; they skip cleanly elsewhere)
if [ "${GEN_TESTS:-1}" != 0 ]; then  # GEN_TESTS=0 skips (ci/gpu's GPU tests already ran the GPU ones)
  "$PY" -m pytest -q -p no:cacheprovider tests/parity/test_generation.py 2>&1 | tee "$OUT/generate_tests.log" || status=1
fi

# 2. the benchmark: engine (GPU) + official eager GPU forward on the same weights
t0=$(date +%s)
"$PY" -m parity.cli bench --synthetic real-widths --backend engine --device cuda \
    --layers "${BENCH_LAYERS:-4}" --budget-s "${BENCH_BUDGET_S:-40}" --timeout-s "${BENCH_TIMEOUT_S:-150}" \
    --repeats 3 --warmup 1 \
    --overwrite --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1
echo "gpu_bench: bench took $(( $(date +%s) - t0 )) s; results in $OUT/bench.json"

# 3. speculative verify cost: verify at widths 1..5 vs a decode step and the MTP draft,
#    at real widths (one period + the MTP layer), with the tokens/s-vs-acceptance curve; VERIFY_COST=0 skips
if [ "${VERIFY_COST:-1}" != 0 ]; then
  rm -rf "$QWEN4EXP_CACHE"/synthetic/realwidth-L*  # room in /dev/shm for the checkpoint with the head
  t1=$(date +%s)
  timeout "${VERIFY_COST_TIMEOUT_S:-240}" "$PY" -m parity.bench.verify_cost --synthetic real-widths \
      --layers "${BENCH_LAYERS:-4}" --device cuda --context "${VERIFY_COST_CONTEXT:-2048}" --repeats 5 --warmup 2 \
      --out "$OUT/verify_cost.json" 2>"$OUT/verify_cost.err" | tee "$OUT/verify_cost.log" || status=1
  tail -n 5 "$OUT/verify_cost.err" | tr '\r' '\n' | tail -n 3  # the writer's progress bar is one \r line
  echo "gpu_bench: verify cost took $(( $(date +%s) - t1 )) s; results in $OUT/verify_cost.json"
fi
# 4. full depth: the real 48 layers, weights in memory in each stored format
if [ "${FULL_DEPTH:-1}" != 0 ]; then
  for w in ${FULL_DEPTH_FORMATS:-nvfp4}; do
    t1=$(date +%s)
    echo "gpu_bench: ================ full depth, 48 layers, $w weights in memory ================"
    "$PY" -m parity.cli bench --synthetic real-widths --backend engine --device cuda --layers 48 --weights "$w" \
        --prompt-lens 512,4096 --batches 1,16 --contexts 1024 --repeats 3 --warmup 1 --decode-tokens 8 --no-extras \
        --budget-s $(( ${FULL_DEPTH_TIMEOUT_S:-300} - 60 )) --timeout-s "${FULL_DEPTH_TIMEOUT_S:-300}" --overwrite --out "$OUT/bench-full-$w.json" 2>&1 \
      | grep -vE "it/s\]|s/it\]" | tee "$OUT/bench-full-$w.log" || status=1
    echo "gpu_bench: full depth $w took $(( $(date +%s) - t1 )) s; results in $OUT/bench-full-$w.json"
  done
fi
# 5. llama.cpp as the speed peer (ci/gpu_llamacpp.sh says how): the trimmed source travels as
#    .llama-src/llama.cpp-src.tar.xz (bash ci/llamacpp_src.sh SDIST, then carry .llama-src); it runs when the tarball
#    is there (passed on the H200: build 233 s, prepare 372 s, bench 111 s); LLAMACPP=0 skips. A build started earlier
#    (build --background) is waited for, a finished one reused; a fresh machine builds here first (minutes).
if [ "${LLAMACPP:-1}" != 0 ] && [ -f .llama-src/llama.cpp-src.tar.xz ]; then
  t1=$(date +%s)
  echo "gpu_bench: ================ llama.cpp peer (BF16 / Q8_0 / Q4_K_M vs bf16 / fp8 / nvfp4) ================"
  { if [ -f "${LLAMA_BUILD:-/tmp/llama-build}/build.pid" ]; then bash ci/gpu_llamacpp.sh wait; else bash ci/gpu_llamacpp.sh build; fi; } \
    && bash ci/gpu_llamacpp.sh prepare && bash ci/gpu_llamacpp.sh bench || status=1
  echo "gpu_bench: llama.cpp peer took $(( $(date +%s) - t1 )) s; results in $OUT/llamacpp_peer.json"
fi
rm -rf /dev/shm/qwen4exp
exit $status
