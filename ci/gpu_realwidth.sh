#!/usr/bin/env bash
# The real-width period of ci/gpu: one period (3 GDN + 1 QSA layers with PLE, as real_width_config lays out four) at
# the real widths with the real vocabulary (248,320) and REALWIDTH_EXPERTS routed experts (default 32, top-10), random
# BF16 weights
# (parity.bench.synthetic.cached_synthetic; the n-gram table scaled down as in every synthetic checkpoint), judged by
#     qwen4exp parity MODEL --backend B1 --backend B2 --scenario kl budget --level long --prompts P --page-sizes 16
# for the engine's float32 and bf16 paths on CUDA, both in one process. P: token-id prompts of REALWIDTH_LENGTHS tokens (default
# 7 600 bound: short, mid, and "bound" = the floor's own stream past the QSA bound (2060 tokens at the real bound
# of 2051, with EOS ids inside: parity.harness.floor.floor_prompts), which the floor then measures once, not twice),
# the harness's own token stream. --level long keeps the
# budget suite at the real bound (a prompt crossing it, a decode walking across it, the selections checked);
# QWEN4EXP_LONG_MAX_TOKENS=2200 keeps the long level's one truth stream at the bound cases (2066 tokens).
#
#     OUT=<dir> bash ci/gpu_realwidth.sh      (ci/gpu runs it; NO_REALWIDTH=1 there skips it)
#
# REALWIDTH_BUDGET_S (default 240; 560 in ci/gpu) bounds the whole step, checkpoint write included. The backends are
# judged by ONE run, `parity --backend A --backend B ...` (one process: the reference's truth and floor on the CPU
# are the cost, not the engine, and they are computed once for all backends: the floor's forwards, the KL truth's
# forward per prompt + continuation, the negative control perturbing the reference, the budget suite's truth), on
# REALWIDTH_CORES (default all) of the CPU cores (BLAS, OpenMP and Numba threads), killed by `timeout` at the budget
# left when it starts; a killed run is reported TIMEOUT for every backend (no verdict) and fails the step.
# REALWIDTH_MODEL (a checkpoint or fixture name) and REALWIDTH_BACKENDS (space-separated specs) replace the model
# and the backends, for a check of this script on the CPU (e.g. REALWIDTH_MODEL=tiny REALWIDTH_BACKENDS=reference).
# Writes $OUT/realwidth_run.txt (the run's output: each backend's table under "backend I of N: SPEC"),
# $OUT/realwidth/<i>/report.json (backend i's report; $OUT/realwidth/index.json names them) and
# $OUT/realwidth_summary.txt (the per-backend verdicts ci/gpu's summary prints); exit 0 when every backend passed.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY="${PYTHON:-python3}"  # the interpreter: the caller's (tests pass theirs), else python3 on PATH
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
  MODEL=$(timeout -k 20 "$(left)" "$PY" -c "
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
if ! desc=$("$PY" - "$MODEL" "$PROMPTS" $LENGTHS 2>"$OUT/realwidth_prompts.log" <<'EOF'
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

# one run judging every backend: `parity --backend A --backend B` in one process on one set of truth forwards --
# the floor, the KL truth's one forward per prompt + continuation, the negative control and the budget suite's truth
# are computed once and shared (parity.harness.run.run_parity_many); each backend gets its own thresholds, verdict
# table and $OUT/realwidth/<i>/report.json ($OUT/realwidth/index.json names them); killed at the budget left
cores="${REALWIDTH_CORES:-$(nproc)}"  # ci/gpu runs it alone, on every core
args=()
for b in "${BACKENDS[@]}"; do args+=(--backend "$b"); done
RUN="$OUT/realwidth_run.txt"
lim=$(left); t_run=$(date +%s)
OMP_NUM_THREADS=$cores OPENBLAS_NUM_THREADS=$cores MKL_NUM_THREADS=$cores NUMBA_NUM_THREADS=$cores \
QWEN4EXP_LONG_MAX_TOKENS=2200 timeout -k 20 "$lim" \
  "$PY" -m parity.cli parity "$MODEL" "${args[@]}" --scenario kl budget --level long \
  --prompts "$PROMPTS" --page-sizes 16 --format text --overwrite --out "$OUT/realwidth" >"$RUN" 2>&1
rc=$?
secs=$(( $(date +%s) - t_run ))
n=${#BACKENDS[@]}

{
  echo "real-width period ($desc; $MODEL; kl + budget at --level long; ${n} backends in one process;" \
       "$(( $(date +%s) - t0 ))s of a ${budget}s budget):"
  for i in "${!BACKENDS[@]}"; do
    ex=""   # its own exit code, from the index the run wrote (none for a killed run: an older index is not read)
    [ "$rc" = 124 ] || [ "$rc" = 137 ] || ex=$("$PY" -c "import json, sys
print(json.load(open(sys.argv[1]))['reports'][int(sys.argv[2])]['exit_code'])" "$OUT/realwidth/index.json" "$i" 2>/dev/null)
    echo "  --backend ${BACKENDS[$i]} (exit ${ex:--}; rc=$rc of the run, ${secs}s for all ${n}):"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      # the progress lines (one per finished case, every 10 s, and one as each backend starts) say how far it got;
      # none: still measuring the floor / the truth, which run before the first case
      echo "    TIMEOUT: killed after ${lim}s, no verdict; $RUN holds $(grep -c "" "$RUN") lines, the last:"
      tail -n 3 "$RUN" | sed 's/^/    /'
    elif [ "$n" = 1 ] && grep -q "^scenario  " "$RUN"; then  # one backend: the table as a run of its own prints it
      sed -n '/^scenario  /,/^legend:/p' "$RUN" | grep -v "^legend:" | sed 's/^/    /'; grep "^verdict" "$RUN" | sed 's/^/    /'
    elif grep -q "^backend $(( i + 1 )) of $n: " "$RUN"; then  # its block: the verdict table and the verdict line
      awk -v h="backend $(( i + 1 )) of $n: " '
        index($0, h) == 1 { inb = 1; next }
        inb && (/^backend [0-9]+ of [0-9]+: / || /^verdict over /) { exit }
        inb && /^scenario  / { tab = 1 }
        inb && tab && /^(legend:|resolution:|verdict:)/ { tab = 0 }
        inb && tab { print "    " $0 }
        inb && /^verdict:/ { print "    " $0 }' "$RUN"
    else tail -n 8 "$RUN" | sed 's/^/    /'; fi
  done
} >"$SUM"
cat "$SUM"
[ "$rc" = 0 ]
