#!/usr/bin/env bash
# The real-width period of ci/gpu: one period (3 GDN + 1 QSA layers with PLE, as real_width_config lays out four) at
# the real widths with the real vocabulary (248,320) and REALWIDTH_EXPERTS routed experts (default 32, top-10), random
# BF16 weights
# (parity.bench.synthetic.cached_synthetic; the n-gram table scaled down as in every synthetic checkpoint), judged by
#     qwen4exp parity MODEL --backend B --scenario kl budget --level long --prompts P --page-sizes 16
# for the engine's float32 and bf16 paths on CUDA. P: token-id prompts of REALWIDTH_LENGTHS tokens (default
# 7 600 bound: short, mid, and "bound" = the floor's own stream past the QSA bound (2060 tokens at the real bound
# of 2051, with EOS ids inside: parity.harness.floor.floor_prompts), which the floor then measures once, not twice),
# the harness's own token stream. --level long keeps the
# budget suite at the real bound (a prompt crossing it, a decode walking across it, the selections checked);
# QWEN4EXP_LONG_MAX_TOKENS=2200 keeps the long level's one truth stream at the bound cases (2066 tokens).
#
#     OUT=<dir> bash ci/gpu_realwidth.sh      (ci/gpu runs it; NO_REALWIDTH=1 there skips it)
#
# REALWIDTH_BUDGET_S (default 240; 560 in ci/gpu) bounds the whole step, checkpoint write included. Each run gets REALWIDTH_CORES
# (default all) of the CPU cores (BLAS, OpenMP and Numba threads: the reference's truth and floor on the CPU are the cost, not the engine) and
# is killed by `timeout` at the budget left when it starts; a killed run is reported TIMEOUT (no verdict) and fails
# the step. They share one floor measurement: QWEN4EXP_FLOOR_CACHE points at $OUT/realwidth/floors (emptied
# first); the first run measures the floor and keeps it there, and the next run starts once that entry exists (or
# the first run ended) and reads it, running beside the first (parity.harness.floor_cache: keyed by the weights,
# the prompts, the stores, the orders and the code; a negative control perturbing the reference is kept the same
# way once a run has measured it).
# REALWIDTH_MODEL (a checkpoint or fixture name) and REALWIDTH_BACKENDS (space-separated specs) replace the model
# and the backends, for a check of this script on the CPU (e.g. REALWIDTH_MODEL=tiny REALWIDTH_BACKENDS=reference).
# Writes $OUT/realwidth_<n>.txt (each run's output), $OUT/realwidth/<n>/ (its report.json) and
# $OUT/realwidth_summary.txt (the verdicts ci/gpu's summary prints); exit 0 when every run passed.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT/realwidth"
budget="${REALWIDTH_BUDGET_S:-240}"
t0=$(date +%s)
left() { local s=$(( budget - ($(date +%s) - t0) )); [ "$s" -ge 1 ] && echo "$s" || echo 1; }  # timeout 0 = none
SUM="$OUT/realwidth_summary.txt"
read -r -a BACKENDS <<<"${REALWIDTH_BACKENDS:-engine:device=cuda,precision=float32 engine:device=cuda,precision=bf16}"
LENGTHS="${REALWIDTH_LENGTHS:-7 600 bound}"

# the checkpoint (written once into the synthetic cache; an interrupted write leaves nothing the next call uses)
if [ -n "${REALWIDTH_MODEL:-}" ]; then
  MODEL="$REALWIDTH_MODEL"
else
  MODEL=$(timeout -k 20 "$(left)" python3 -c "
from parity.bench.synthetic import cached_synthetic
n = int('${REALWIDTH_EXPERTS:-32}')
print(cached_synthetic(4, overrides={'num_experts': n, 'num_experts_per_tok': min(10, n)}, progress=False))
" 2>"$OUT/realwidth_model.log")
  rc=$?
  if [ "$rc" != 0 ] || [ -z "$MODEL" ]; then
    { echo "real-width period: no checkpoint (rc=$rc$([ "$rc" = 124 ] && echo ", TIMEOUT after ${budget}s"))"
      tail -n 5 "$OUT/realwidth_model.log"; } | tee "$SUM"
    exit 1
  fi
fi

# the prompts: one JSON list of token-id lists (the --prompts format of every verb), ids from the model's vocabulary
PROMPTS="$OUT/realwidth/prompts.json"
if ! desc=$(python3 - "$MODEL" "$PROMPTS" $LENGTHS 2>"$OUT/realwidth_prompts.log" <<'EOF'
import sys
from parity.harness.floor import floor_prompts
from parity.harness.scenarios.common import token_stream
from reference.atomic import atomic_write_json
from reference.config import load_config
from reference.paths import resolve_model
cfg = load_config(resolve_model(sys.argv[1]))
# "bound": the floor's own stream past the QSA bound (parity.harness.floor.floor_prompts), so the floor measures
# it once as a KL prompt and as its stream
ps = [floor_prompts(cfg, None)[-1] if n == "bound" else token_stream(cfg, int(n), seed=4100 + i)
      for i, n in enumerate(sys.argv[3:])]
atomic_write_json(sys.argv[2], ps, indent=None)
print(f"prompts of {', '.join(str(len(p)) for p in ps)} tokens; ", end="")
print(f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
      f"vocab {cfg.vocab_size}")
EOF
); then
  { echo "real-width period: the prompts could not be written"; tail -n 5 "$OUT/realwidth_prompts.log"; } | tee "$SUM"
  exit 1
fi

# the runs, each on all of the cores: the first alone until it has kept its floor (or ended), then the next beside
# it -- it reads that floor instead of measuring it; the reference's forwards are largely single-threaded NumPy at
# these widths, so two runs side by side lose little to each other
cores="${REALWIDTH_CORES:-$(nproc)}"  # ci/gpu runs it alone, on every core
export QWEN4EXP_FLOOR_CACHE="$OUT/realwidth/floors"
rm -rf "$QWEN4EXP_FLOOR_CACHE"
rc_all=0
rcs=()
lims=()
secs=()
pids=()
starts=()
start_run() {  # start_run I: backend I in the background, killed at the budget left
  local i=$1 lim; lim=$(left); lims[$i]=$lim; starts[$i]=$(date +%s)
  OMP_NUM_THREADS=$cores OPENBLAS_NUM_THREADS=$cores MKL_NUM_THREADS=$cores NUMBA_NUM_THREADS=$cores \
  QWEN4EXP_LONG_MAX_TOKENS=2200 timeout -k 20 "$lim" \
    python3 -m parity.cli parity "$MODEL" --backend "${BACKENDS[$i]}" --scenario kl budget --level long \
    --prompts "$PROMPTS" --page-sizes 16 --format text --overwrite --out "$OUT/realwidth/$i" \
    >"$OUT/realwidth_$i.txt" 2>&1 &
  pids[$i]=$!
}
floor_kept() { compgen -G "$QWEN4EXP_FLOOR_CACHE/floor-*.json" >/dev/null; }
for i in "${!BACKENDS[@]}"; do
  start_run "$i"
  # the next run waits for this one's floor entry (or its end)
  while [ "$i" -lt $(( ${#BACKENDS[@]} - 1 )) ] && kill -0 "${pids[$i]}" 2>/dev/null && ! floor_kept; do sleep 1; done
done
for i in "${!BACKENDS[@]}"; do
  wait "${pids[$i]}"; r=$?; rcs[$i]=$r; secs[$i]=$(( $(date +%s) - ${starts[$i]} ))
  [ "$r" = 0 ] || rc_all=1
done

{
  echo "real-width period ($desc; $MODEL; kl + budget at --level long;" \
       "$(( $(date +%s) - t0 ))s of a ${budget}s budget):"
  for i in "${!BACKENDS[@]}"; do
    f="$OUT/realwidth_$i.txt"
    echo "  --backend ${BACKENDS[$i]} (rc=${rcs[$i]}, ${secs[$i]}s):"
    if [ "${rcs[$i]}" = 124 ] || [ "${rcs[$i]}" = 137 ]; then
      # the progress lines (one per finished case, and every 10 s) say how far it got; none: still measuring the
      # floor / the truth, which run before the first case
      echo "    TIMEOUT: killed after ${lims[$i]}s, no verdict; $f holds $(grep -c "" "$f") lines, the last:"
      tail -n 3 "$f" | sed 's/^/    /'
    elif grep -q "^scenario  " "$f"; then  # the verdict table and the verdict line
      sed -n '/^scenario  /,/^legend:/p' "$f" | grep -v "^legend:" | sed 's/^/    /'; grep "^verdict" "$f" | sed 's/^/    /'
    else tail -n 8 "$f" | sed 's/^/    /'; fi
  done
} >"$SUM"
cat "$SUM"
exit "$rc_all"
