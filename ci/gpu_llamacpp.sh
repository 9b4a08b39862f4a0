#!/usr/bin/env bash
# llama.cpp (CUDA, sm_90) as the speed peer of the engine bench. Runs ON THE GPU MACHINE from the
# repository root; OUT = the results folder (default ci/out).
#
# How to run it:
#   1. here (the machine with llama-cpp-python's sdist):
#        bash ci/llamacpp_src.sh /work/llama/llama_cpp_python-0.3.36.tar.gz     # -> .llama-src/llama.cpp-src.tar.xz
#   2. on the device, every call with carry [".llama-src", ".whl"] (one call is <= 600 s and <= 2000 characters):
#        bash ci/gpu_llamacpp.sh build --background     # returns at once; the build goes on (setsid) while the
#                                                       # machine is held: other GPU work can run meanwhile
#        bash ci/gpu_llamacpp.sh prepare --background   # synthetic checkpoint -> BF16 GGUF now (CPU only), then
#                                                       # Q8_0 / Q4_K_M once the build is done (~45 GB in $LLAMA_MODELS)
#        ...                                            # (other device calls)
#        bash ci/gpu_llamacpp.sh wait prepare           # (prepare ends after the build; `wait` = the build alone)
#        bash ci/gpu_llamacpp.sh bench --background     # ~7-9 minutes: 3 GGUFs x (llama-bench + batched-bench)
#        bash ci/gpu_llamacpp.sh wait bench             #   + 3 engine runs; prints the ratio table
#      `wait [STEP]` blocks until STEP (default build) ends (at most WAIT_S, default 540 s; rc 124 = still running:
#      call it again) and copies STEP's log and results into this call's $OUT. `bench` in the foreground fits one
#      600 s call only when shortened (REPS=2, ENGINE_FORMATS=nvfp4, ...).
#
# Subcommands:
#   build [--background]  untar .llama-src/llama.cpp-src.tar.xz to $LLAMA_SRC (/tmp/llama-src), configure (CUDA,
#                         sm_90, Release, native CPU flags, no tests/examples/server/curl/openssl/NCCL) and
#                         `ninja llama-bench llama-batched-bench llama-quantize` in $LLAMA_BUILD (/tmp/llama-build).
#                         Log: $LLAMA_BUILD/llamacpp-build.log; marker $LLAMA_BUILD/BUILD_DONE (or BUILD_FAILED,
#                         holding the exit status); both copied to $OUT. Prints the build time. A finished build
#                         is not redone (FORCE=1 redoes it).
#   prepare [--background] python -m parity.bench.llamacpp_peer prepare: the engine bench's synthetic real-width
#                         checkpoint (BENCH_LAYERS, default 4) -> BF16 GGUF (the trimmed tree's converter) ->
#                         llama-quantize Q8_0 and Q4_K_M, into $LLAMA_MODELS (/tmp/llamacpp-models on the disk
#                         when it has 50 GB free, else /dev/shm/llamacpp-models: the engine's fp8 / nvfp4 runs
#                         hold a 51 GB table in host memory); manifest.json there. The
#                         safetensors copy is removed after the conversion. Steps done are not redone.
#                         (PREPARE_OVERRIDES='{"hidden_size": 256, ...}': small widths, for a dry run elsewhere.)
#   bench [--background]  python -m parity.bench.llamacpp_peer run: llama-bench + llama-batched-bench on each GGUF,
#                         the engine bench (bf16 / fp8 / nvfp4 in memory, same shapes), the ratio table; results
#                         (raw llama.cpp outputs and errors, engine JSONs, llamacpp_peer.json) in $OUT.
#   wait [build|prepare|bench]   see above.
#   status                print each step's state and the build log's last lines.
#
# What keeps the compile time down without changing a kernel the benchmark runs: one CUDA architecture (90);
# FlashAttention vector kernels only for the f16 / bf16 K-V cache (GGML_CUDA_FA_QUANTS; llama-bench's default
# cache type is f16 and it is not changed here); no binary compression (GGML_CUDA_COMPRESSION_MODE=none: a
# link-time size option); only the three targets are built.
set -uo pipefail
cd "${LLAMACPP_REPO:-$(dirname "$0")/..}"  # LLAMACPP_REPO: set for the background copy of this script
REPO="$PWD"
OUT="${OUT:-ci/out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
TARBALL="${LLAMA_TARBALL:-$REPO/.llama-src/llama.cpp-src.tar.xz}"
SRC="${LLAMA_SRC:-/tmp/llama-src}"
BUILD="${LLAMA_BUILD:-/tmp/llama-build}"
BIN="$BUILD/bin"
LOG="$BUILD/llamacpp-build.log"
TARGETS=(llama-bench llama-batched-bench llama-quantize)

say() { echo "gpu_llamacpp: $*"; }

copy_build_files() {  # the log and the marker into this call's OUT (each device call has a fresh OUT)
  [ -f "$LOG" ] && cp -f "$LOG" "$OUT/llamacpp-build.log"
  for m in BUILD_DONE BUILD_FAILED; do [ -f "$BUILD/$m" ] && cp -f "$BUILD/$m" "$OUT/llamacpp-$m"; done
  return 0
}

do_build() {
  mkdir -p "$BUILD"
  if [ -f "$BUILD/BUILD_DONE" ] && [ "${FORCE:-0}" = 0 ] && [ -x "$BIN/llama-bench" ]; then
    say "already built ($(cat "$BUILD/BUILD_DONE")); FORCE=1 rebuilds"
    copy_build_files
    return 0
  fi
  rm -f "$BUILD/BUILD_DONE" "$BUILD/BUILD_FAILED"
  mkdir -p "$(dirname "$SRC")"
  local t0 rc=0
  t0=$(date +%s)
  (  # a subshell: its exits end the build, not this script
    echo "== $(date -u +%FT%TZ) build of llama.cpp for CUDA sm_90 from $TARBALL"
    [ -f "$TARBALL" ] || { echo "expected the trimmed source at $TARBALL (bash ci/llamacpp_src.sh SDIST here, then carry .llama-src), found nothing"; exit 2; }
    x="$(mktemp -d "$(dirname "$SRC")/.llama-src.XXXXXX")" && tar xJf "$TARBALL" -C "$x" && rm -rf "$SRC" \
      && mv "$x/llama.cpp" "$SRC" && rmdir "$x" || { echo "could not unpack $TARBALL into $SRC"; exit 2; }
    commit="$(cat "$SRC/LLAMACPP_COMMIT" 2>/dev/null || echo unknown)"
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
    echo "== llama.cpp commit $commit; nvcc $(command -v nvcc): $(nvcc --version 2>/dev/null | tail -n 1); $(cmake --version | head -n 1); ninja $(ninja --version); $(nproc) cores"
    cmake -S "$SRC" -B "$BUILD" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CUDA_NCCL=OFF \
      -DGGML_CUDA_FA_ALL_QUANTS=OFF "-DGGML_CUDA_FA_QUANTS=f16-f16;bf16-bf16" -DGGML_CUDA_COMPRESSION_MODE=none \
      -DLLAMA_BUILD_COMMIT="${commit:0:7}" -DLLAMA_BUILD_NUMBER=0 || exit 3
    echo "== configure took $(( $(date +%s) - t0 )) s"
    ninja -C "$BUILD" -j"$(nproc)" "${TARGETS[@]}" || exit 4
  ) > "$LOG" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ "$rc" = 0 ]; then
    echo "built in $dt s: ${TARGETS[*]} in $BIN" > "$BUILD/BUILD_DONE"
    say "llama.cpp built in $dt s ($BIN)"
  else
    echo "rc $rc after $dt s (see $LOG)" > "$BUILD/BUILD_FAILED"
    say "llama.cpp build FAILED (rc $rc) after $dt s; last lines of $LOG:"
    grep -E "error|Error|FAILED" "$LOG" | head -n 20
    tail -n 15 "$LOG"
  fi
  copy_build_files
  return "$rc"
}

WORK="${LLAMA_WORK:-/tmp/llamacpp-work}"   # the steps' logs, markers and results: they outlive a device call
free_kb() { df -Pk "$1" 2>/dev/null | awk 'NR==2{print $4}'; }
# GGUFs (~44 GB at 4 layers: BF16 23.5 + Q8_0 12.5 + Q4_K_M ~7.5) on the disk when it has room (the engine's
# fp8 / nvfp4 runs then have the host memory for their 51 GB n-gram table), else in /dev/shm
if [ -z "${LLAMA_MODELS:-}" ]; then
  if [ "$(free_kb /tmp)" -gt $(( 50 * 1024 * 1024 )) ] 2>/dev/null || [ -d /tmp/llamacpp-models ]; then LLAMA_MODELS=/tmp/llamacpp-models
  else LLAMA_MODELS=/dev/shm/llamacpp-models; fi
fi
MODELS="$LLAMA_MODELS"
# the synthetic safetensors (23.5 GB, removed once converted) in RAM-backed /dev/shm when it has room, as
# ci/gpu_bench.sh does (the same cache: do not run ci/gpu_bench.sh while prepare converts)
if [ -z "${QWEN4EXP_CACHE:-}" ]; then
  if [ "$(free_kb /dev/shm)" -gt $(( 30 * 1024 * 1024 )) ] 2>/dev/null; then export QWEN4EXP_CACHE=/dev/shm/qwen4exp
  else export QWEN4EXP_CACHE=/tmp/qwen4exp; fi
fi
export LLAMA_SRC="$SRC" LLAMA_BUILD="$BUILD" LLAMA_MODELS="$MODELS"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

marker_dir() { if [ "$1" = build ]; then echo "$BUILD"; else echo "$WORK"; fi; }
MARK() { echo "$(marker_dir "$1")/$(echo "$1" | tr a-z A-Z)_$2"; }  # MARK step DONE|FAILED

copy_step_files() {  # $1 = step: its log and results into this call's OUT
  if [ "$1" = build ]; then copy_build_files; return 0; fi
  [ -f "$WORK/$1.log" ] && cp -f "$WORK/$1.log" "$OUT/llamacpp-$1.log"
  for m in DONE FAILED; do [ -f "$(MARK "$1" $m)" ] && cp -f "$(MARK "$1" $m)" "$OUT/llamacpp-$1-$m"; done
  if [ "$1" = prepare ]; then
    for f in "$MODELS"/manifest.json "$MODELS"/*.log; do [ -f "$f" ] && cp -f "$f" "$OUT/"; done
  fi
  if [ "$1" = bench ] && [ -d "$WORK/results" ]; then cp -rf "$WORK/results/." "$OUT/"; fi
  return 0
}

run_step() {  # $1 = prepare|bench, in the foreground: log to $WORK/$1.log (and the terminal), marker, copy
  local step="$1" rc=0 t0
  mkdir -p "$WORK"; rm -f "$(MARK "$step" DONE)" "$(MARK "$step" FAILED)"
  t0=$(date +%s)
  case "$step" in
    prepare)
      "${PYTHON:-python3}" -m parity.bench.llamacpp_peer prepare --src "$SRC" --bin "$BIN" --models "$MODELS" \
          --layers "${BENCH_LAYERS:-4}" --build-dir "$BUILD" ${PREPARE_OVERRIDES:+--overrides "$PREPARE_OVERRIDES"} 2>&1 \
        | tee "$WORK/prepare.log"; rc=${PIPESTATUS[0]} ;;
    bench)
      [ -f "$BUILD/BUILD_DONE" ] || { say "expected a finished build (bash ci/gpu_llamacpp.sh build / wait), found none"; return 2; }
      [ -f "$MODELS/manifest.json" ] || { say "expected the GGUFs (bash ci/gpu_llamacpp.sh prepare), found no $MODELS/manifest.json"; return 2; }
      rm -rf "$WORK/results"; mkdir -p "$WORK/results"
      "${PYTHON:-python3}" -m parity.bench.llamacpp_peer run --bin "$BIN" --models "$MODELS" --out-dir "$WORK/results" \
          --layers "${BENCH_LAYERS:-4}" --reps "${REPS:-3}" ${ENGINE_FORMATS:+--formats "$ENGINE_FORMATS"} 2>&1 \
        | grep -vE "it/s\]|s/it\]" | tee "$WORK/bench.log"; rc=${PIPESTATUS[0]} ;;
  esac
  if [ "$rc" = 0 ]; then echo "$step done in $(( $(date +%s) - t0 )) s" > "$(MARK "$step" DONE)"
  else echo "$step rc $rc after $(( $(date +%s) - t0 )) s" > "$(MARK "$step" FAILED)"; fi
  say "$step: exit $rc after $(( $(date +%s) - t0 )) s"
  copy_step_files "$step"
  return "$rc"
}

start_background() {  # $1 = step: the same script under setsid, surviving this call while the machine is held
  local step="$1" d; d="$(marker_dir "$step")"; mkdir -p "$d"
  if [ -f "$d/$step.pid" ] && kill -0 "$(cat "$d/$step.pid")" 2>/dev/null; then
    say "$step is already under way (pid $(cat "$d/$step.pid"))"; return 0
  fi
  rm -f "$(MARK "$step" DONE)" "$(MARK "$step" FAILED)"
  # a copy of this script runs: bash reads a script as it goes, and a later device call re-copies the tree
  cp -f "$REPO/ci/gpu_llamacpp.sh" "$d/$step.sh"
  OUT="$OUT" LLAMACPP_REPO="$REPO" setsid nohup bash "$d/$step.sh" "$step" > "$d/$step.out" 2>&1 < /dev/null &
  echo $! > "$d/$step.pid"
  say "$step started in the background (pid $!); bash ci/gpu_llamacpp.sh wait $step blocks until it ends"
}

do_wait() {  # $1 = step
  local step="${1:-build}" limit="${WAIT_S:-540}" t0 d
  d="$(marker_dir "$step")"; t0=$(date +%s)
  while [ ! -f "$(MARK "$step" DONE)" ] && [ ! -f "$(MARK "$step" FAILED)" ]; do
    if [ ! -f "$d/$step.pid" ] || ! kill -0 "$(cat "$d/$step.pid")" 2>/dev/null; then
      sleep 2  # the marker is written just before the process ends
      [ -f "$(MARK "$step" DONE)" ] || [ -f "$(MARK "$step" FAILED)" ] && break
      say "$step: nothing under way and no marker (start it: bash ci/gpu_llamacpp.sh $step --background)"
      [ -f "$d/$step.out" ] && tail -n 20 "$d/$step.out"
      copy_step_files "$step"; return 2
    fi
    if [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then
      say "$step still running after waiting $limit s; call wait $step again"
      if [ "$step" = build ]; then grep -aoE '\[[0-9]+/[0-9]+\]' "$LOG" 2>/dev/null | tail -n 1; else tail -n 3 "$WORK/$step.log" 2>/dev/null; fi
      copy_step_files "$step"; return 124
    fi
    sleep 5
  done
  copy_step_files "$step"
  if [ -f "$(MARK "$step" DONE)" ]; then
    say "$(cat "$(MARK "$step" DONE)")"
    [ "$step" = bench ] && [ -f "$WORK/bench.log" ] && sed -n '/^| engine |/,$p' "$WORK/bench.log"
    return 0
  fi
  say "$step failed: $(cat "$(MARK "$step" FAILED)")"
  if [ "$step" = build ]; then grep -E "error" "$LOG" | head -n 20; tail -n 15 "$LOG"
  elif [ "$step" = bench ] && grep -q '^| engine |' "$WORK/bench.log" 2>/dev/null; then
    say "(bench exits 1 when a ratio is missing: a side failed or the same-model check refused; the table says which)"
    sed -n '/^| engine |/,$p' "$WORK/bench.log"
  else tail -n 25 "$WORK/$step.log" 2>/dev/null; fi
  return 1
}

do_status() {
  local st
  for st in build prepare bench; do
    if [ -f "$(MARK "$st" DONE)" ]; then say "$st: $(cat "$(MARK "$st" DONE)")"
    elif [ -f "$(MARK "$st" FAILED)" ]; then say "$st: FAILED: $(cat "$(MARK "$st" FAILED)")"
    elif [ -f "$(marker_dir "$st")/$st.pid" ] && kill -0 "$(cat "$(marker_dir "$st")/$st.pid")" 2>/dev/null; then
      if [ "$st" = build ]; then say "build: running $(grep -aoE '\[[0-9]+/[0-9]+\]' "$LOG" 2>/dev/null | tail -n 1)"
      else say "$st: running: $(tail -n 1 "$WORK/$st.log" 2>/dev/null)"; fi
    else say "$st: not started"; fi
  done
  [ -f "$LOG" ] && tail -n 3 "$LOG"
  df -h /tmp /dev/shm 2>/dev/null | tail -n 2; free -g | head -n 2
  copy_build_files
}

cmd="${1:-}"; shift || true
case "$cmd" in
  build|prepare|bench)
    if [ "${1:-}" = "--background" ]; then start_background "$cmd"; exit 0; fi
    if [ "$cmd" = build ]; then do_build; else run_step "$cmd"; fi ;;
  wait) do_wait "${1:-build}" ;;
  status) do_status ;;
  *) sed -n '2,52p' "$0"; [ -z "$cmd" ] && exit 0; say "unknown subcommand '$cmd'"; exit 2 ;;
esac
