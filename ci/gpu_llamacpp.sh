#!/usr/bin/env bash
# llama.cpp (CUDA, sm_90) as the speed peer of the engine bench (issue 16 item 4). Runs ON THE GPU MACHINE from the
# repository root; OUT = the results folder (default ci/out).
#
# How to run it:
#   1. here (the machine with llama-cpp-python's sdist):
#        bash ci/llamacpp_src.sh /work/llama/llama_cpp_python-0.3.36.tar.gz     # -> .llama-src/llama.cpp-src.tar.xz
#   2. on the device, every call with carry [".llama-src", ".whl"] (one call is <= 600 s and <= 2000 characters):
#        bash ci/gpu_llamacpp.sh build --background     # returns at once; the build goes on (setsid) while the
#                                                       # machine is held: other GPU work can run meanwhile
#        ...                                            # (other device calls)
#        bash ci/gpu_llamacpp.sh wait && bash ci/gpu_llamacpp.sh bench
#      `wait` blocks until the build's marker (at most WAIT_S, default 540 s; rc 124 = still building: call again).
#
# Subcommands:
#   build [--background]  untar .llama-src/llama.cpp-src.tar.xz to $LLAMA_SRC (/tmp/llama-src), configure (CUDA,
#                         sm_90, Release, native CPU flags, no tests/examples/server/curl/openssl/NCCL) and
#                         `ninja llama-bench llama-batched-bench llama-quantize` in $LLAMA_BUILD (/tmp/llama-build).
#                         Log: $LLAMA_BUILD/llamacpp-build.log; marker $LLAMA_BUILD/BUILD_DONE (or BUILD_FAILED,
#                         holding the exit status); both copied to $OUT. Prints the build time. A finished build
#                         is not redone (FORCE=1 redoes it).
#   wait                  block until the marker exists; copy the log and marker to $OUT; rc 0 built, 1 failed,
#                         124 still building after WAIT_S.
#   status                print the build's state and the log's last lines.
#   bench                 (see its section below)
#
# What keeps the compile time down without changing a kernel the benchmark runs: one CUDA architecture (90);
# FlashAttention vector kernels only for the f16 / bf16 K-V cache (GGML_CUDA_FA_QUANTS; llama-bench's default
# cache type is f16 and it is not changed here); no binary compression (GGML_CUDA_COMPRESSION_MODE=none: a
# link-time size option); only the three targets are built.
set -uo pipefail
cd "$(dirname "$0")/.."
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

do_wait() {
  local limit="${WAIT_S:-540}" t0
  t0=$(date +%s)
  while [ ! -f "$BUILD/BUILD_DONE" ] && [ ! -f "$BUILD/BUILD_FAILED" ]; do
    if [ ! -f "$LOG" ] && [ ! -f "$BUILD/build.pid" ]; then
      say "no build under way or finished in $BUILD (run: bash ci/gpu_llamacpp.sh build --background)"; return 2
    fi
    if [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then
      say "still building after waiting $limit s: $(grep -aoE '\[[0-9]+/[0-9]+\]' "$LOG" 2>/dev/null | tail -n 1); call wait again"
      copy_build_files; return 124
    fi
    sleep 5
  done
  copy_build_files
  if [ -f "$BUILD/BUILD_DONE" ]; then say "$(cat "$BUILD/BUILD_DONE")"; return 0; fi
  say "build failed: $(cat "$BUILD/BUILD_FAILED")"; grep -E "error" "$LOG" | head -n 20; tail -n 15 "$LOG"; return 1
}

do_status() {
  if [ -f "$BUILD/BUILD_DONE" ]; then say "built: $(cat "$BUILD/BUILD_DONE")"
  elif [ -f "$BUILD/BUILD_FAILED" ]; then say "failed: $(cat "$BUILD/BUILD_FAILED")"
  elif [ -f "$LOG" ]; then say "building: $(grep -aoE '\[[0-9]+/[0-9]+\]' "$LOG" | tail -n 1)"
  else say "not started"; fi
  [ -f "$LOG" ] && tail -n 5 "$LOG"
  copy_build_files
}

cmd="${1:-}"; shift || true
case "$cmd" in
  build)
    if [ "${1:-}" = "--background" ]; then
      mkdir -p "$BUILD"
      if [ -f "$BUILD/build.pid" ] && kill -0 "$(cat "$BUILD/build.pid")" 2>/dev/null; then
        say "a build is already under way (pid $(cat "$BUILD/build.pid"))"; exit 0
      fi
      OUT="$OUT" setsid nohup bash "$REPO/ci/gpu_llamacpp.sh" build > "$BUILD/build.out" 2>&1 < /dev/null &
      echo $! > "$BUILD/build.pid"
      say "build started in the background (pid $!; log $LOG); bash ci/gpu_llamacpp.sh wait blocks until it ends"
      exit 0
    fi
    do_build ;;
  wait) do_wait ;;
  status) do_status ;;
  bench)
    [ -f "$BUILD/BUILD_DONE" ] || { say "expected a finished build (bash ci/gpu_llamacpp.sh build / wait), found none"; exit 2; }
    exec "${PYTHON:-python3}" -m parity.bench.llamacpp_peer run --bin "$BIN" --out-dir "$OUT" "$@" ;;
  *) sed -n '2,32p' "$0"; [ -z "$cmd" ] && exit 0; say "unknown subcommand '$cmd'"; exit 2 ;;
esac
