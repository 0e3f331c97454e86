#!/usr/bin/env bash
# The GPU validation pack: one command on a GPU machine, within 8 minutes on one H100.
#
#   bash launch/gpu_validate.sh          # PYTHON=... to choose the interpreter (default: python)
#   bash launch/gpu_validate.sh --plan   # the steps, their budgets and what they project; runs nothing
#   bash launch/gpu_validate.sh --cpu    # the same pipeline on CPU (a check of the pack itself; with
#                                        # --plan: its budgets, x3, within 2000 s)
#
# A GPU session has at most 10 minutes per command and ~15 minutes of device time, the machine's
# start included, so the pack has a deadline (PACK_BUDGET_S, 480 s on a GPU) and every step a time
# budget (the PLAN below, in seconds on one H100; PACK_SCALE multiplies them). A step starts only
# when its whole budget fits before the deadline (else SKIP "no time left"), and runs under
# `timeout` with it (over budget: killed, FAIL). The most valuable checks come first, the report is
# written right after the searches, and again at the end in a budget kept for it.
# One PASS / FAIL / SKIP / INFO line per check, then a summary; exit 1 if any check failed. The lines,
# each step's time against its budget and every log go to reports/gpu/<device>/: commit them.
#
# What the smoke test (launch/gpu_smoke.sh, ~10 min) checks is folded in, not run again: the
# ZeRO-3 search runs on the last GPU, and its last trial is the smoke test's 1-GPU trial and NVML
# mapping check (one GPU, nvidia-smi's UUID for that index) with its per-rank memory lines; each
# search's trials must be forked from one pool and, on a GPU, bounded by a real CUDA OOM and reported
# against the emulated card (the smoke test's CUDA-OOM search); the 2-GPU NCCL trial is the 2-rank
# ZeRO-3 search. The searches run Qwen2.5-0.5B (its real config.json: GQA, SwiGLU, RMSNorm, RoPE)
# at seq 1024 with model.attention=sdpa (CUDA's flash kernels, as users on an H100 run it) under
# an emulated 24 GiB card.
set -uo pipefail
cd "$(dirname "$0")/.."

# name  budget (s, one H100)  where (any; gpu: not with --cpu; 2gpu: 2+ GPUs)  what, in the order the pack runs them
PLAN=$(cat <<'STEPS'
gpu           15  gpu   nvidia-smi lists the GPUs; one with a 1 GiB tensor: nvidia-smi next to NVML, CUDA, torch
calibrate    120  any   zero_bench calibrate, the first launch: DeepSpeed's one-time FusedAdam build, inductor's first compiles (killed, every later step would pay them again)
calibrated    15  any   the estimate says "calibrated on <device>"
zero3        100  any   max-batch search, DeepSpeed ZeRO-3, on the last GPU (its first trial compiles the fusions for Qwen); its last trial: 1-GPU, NVML mapping, memory lines
fsdp2-check   15  any   the estimate of the FSDP2 search (SKIP where FSDP2 refuses the model)
fsdp2         80  any   max-batch search, FSDP2 zero=3
verdicts      20  any   each search: boundary confirmed, one pool, real CUDA OOM; the estimate against it, term by term
report        25  any   reports/gpu/<device>/ written (the first time)
tp2           30  2gpu  2+ GPUs: gpt-tiny tp=2 over NCCL
ulysses       30  2gpu  2+ GPUs: llama-tiny parallel.sp=2, ZeRO-3, bf16: the two ranks split each 16K-token sequence (DeepSpeed's all-to-all over NCCL)
ulysses-sp1   30  2gpu  2+ GPUs: the same run at sp=1: every step's loss and gradient norm beside sp=2's; sp=2's peak beside the estimate
dp2           80  2gpu  2+ GPUs: a 2-rank ZeRO-3 search
ep2-zero2     30  2gpu  2+ GPUs: moe-tiny ep=2, DeepSpeed ZeRO-2 (megatron's alltoall dispatcher over NCCL)
ep2-fsdp2     30  2gpu  2+ GPUs: moe-tiny ep=2, FSDP2 zero=3, recompute=op
zeropp2       90  2gpu  2+ GPUs: ZeRO++ qwZ + hpZ 2, ZeRO-3 over NCCL: int8 all-gathers (DeepSpeed's quantizer JIT-built first; qgZ needs 2 nodes)
maxseq-tiled  45  gpu   maxseq search, llama-tiny ZeRO-1 bf16 with tiled_mlp=auto and recompute=full + recompute_offload, emulated 3 GiB card, to 4,096 tokens: boundary, real CUDA OOM, estimate
op-zero1      25  gpu   recipe: per-op recompute (torch's selective checkpoint, CUDA's flash kernel), ZeRO-1
moe-fsdp2-op  25  gpu   recipe: the mixture of experts, FSDP2, per-op recompute
bf16-states   25  gpu   recipe: pure bf16 states, ZeRO-2
chunked-loss  25  gpu   recipe: the chunked loss, ZeRO-3
op-fsdp2      25  gpu   recipe: per-op recompute, FSDP2
moe-zero2     25  gpu   recipe: the mixture of experts, ZeRO-2
zeropp-qwz    90  gpu   recipe: ZeRO++ qwZ, ZeRO-3 on one GPU: DeepSpeed's quantizer built and loaded by zero.Init (no CPU kernel; zeropp2 gathers it)
zero1         80  any   max-batch search, ZeRO-1 (as time allows)
zero2         80  any   max-batch search, ZeRO-2 (as time allows)
zero0         80  any   max-batch search, ZeRO-0 (as time allows)
verdicts2     20  any   the verdicts of the searches just above
final-report  20  any   reports/gpu/<device>/ written again with everything (its budget is kept for it)
STEPS
)
CORE_END=report  # the steps up to and including it: what the first report holds

# a step's budget in whole seconds (at least 1): its PLAN figure x PACK_SCALE (a decimal number)
plan_budget() { awk -v n="$1" -v s="$SCALE" '$1 == n {b = int($2 * s + 0.5); print (b < 1 ? 1 : b)}' <<<"$PLAN"; }

MODE=gpu; PLAN_ONLY=0
for arg in "$@"; do
  case $arg in --cpu) MODE=cpu;; --plan) PLAN_ONLY=1;; *) echo "usage: $0 [--cpu] [--plan]" >&2; exit 2;; esac
done
if [ "$MODE" = cpu ]; then SCALE=${PACK_SCALE:-3}; BUDGET=${PACK_BUDGET_S:-2000}  # 2 CPU ranks are slower
else SCALE=${PACK_SCALE:-1}; BUDGET=${PACK_BUDGET_S:-480}; fi

if [ "$PLAN_ONLY" = 1 ]; then  # what the budgets project: every step spending its whole budget, on one GPU
  awk -v deadline="$BUDGET" -v scale="$SCALE" -v core="$CORE_END" -v cpu="$([ "$MODE" = cpu ] && echo 1)" '
    { b = int($2 * scale + 0.5); if (b < 1) b = 1; printf "%-12s %4d s  %-4s  %s\n", $1, b, $3, substr($0, index($0, $4))
      if ($3 == "2gpu" || ($3 == "gpu" && cpu)) next  # the projection is for one GPU (or --cpu)
      if ($1 == "final-report") { final = b; next }
      name[++n] = $1; cost[n] = b }
    END {
      for (i = 1; i <= n; i++) {
        if (name[i] == "verdicts2" && !extra) continue  # only after a search of its own
        if (t + cost[i] <= deadline - final) { t += cost[i]; ran = ran " " name[i]; if (name[i] ~ /^zero[012]$/) extra = 1 }
        else skipped = skipped " " name[i]
        if (name[i] == core) first = t }
      printf "one GPU (--cpu: the CPU pipeline), every step taking its whole budget: the first report by %d s, the pack ends by %d s (deadline %d s)\n", first, t + final, deadline
      printf "  runs:%s final-report\n  skipped (no time left):%s\n", ran, skipped ? skipped : " none" }' <<<"$PLAN"
  exit 0
fi

PY=${PYTHON:-python}
ZB=("$PY" -m zero_bench)
OUT=$(mktemp -d "${TMPDIR:-/tmp}/zero_bench_validate.XXXXXX")
STORE="$OUT/validate.sqlite"
T0=$(date +%s)
FINAL=$(plan_budget final-report)
DEADLINE=$(( T0 + BUDGET - FINAL ))  # the last step must end by then: the final report's budget is kept
pass=0; fail=0; skip=0
say() { printf '%-5s %-12s %s\n' "$1" "$2" "$3" | tee -a "$OUT/pack.txt"; count "$1"; }
count() { case $1 in PASS) pass=$((pass+1));; FAIL) fail=$((fail+1));; SKIP) skip=$((skip+1));; esac; }
# a query's verdict lines (DeepSpeed's import may log to stdout too), counted in this shell
relay() { while read -r verdict name rest; do case $verdict in PASS|FAIL|SKIP|INFO) say "$verdict" "$name" "$rest";; esac; done; }
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
tail_of() { tail -c 300 "$1" 2>/dev/null | tr '\n' ' '; }
ran() { [ "$RC" != 200 ] && [ "$RC" != 124 ] && [ "$RC" != 137 ]; }  # the last step ran to its end

# step NAME LOG COMMAND...: COMMAND under its budget from the PLAN, if that fits before the deadline.
# RC: the command's exit status; 124 / 137 over budget (killed, one FAIL line); 200 not started
# (one SKIP line). Each step's time against its budget goes to timings.txt.
step() {
  local name=$1 log=$2; shift 2
  local budget start now left
  budget=$(plan_budget "$name")
  now=$(date +%s); left=$(( DEADLINE - now ))
  [ "$name" = final-report ] && left=$(( DEADLINE + FINAL - now ))
  if [ "$left" -lt "$budget" ]; then
    say SKIP "$name" "no time left: its budget ${budget} s, ${left} s left of the pack's ${BUDGET} s"
    RC=200; echo "$name - $budget skipped" >> "$OUT/timings.txt"; return
  fi
  start=$now
  timeout -k 15 "$budget" "$@" > "$log" 2>&1 < /dev/null
  RC=$?
  echo "$name $(( $(date +%s) - start )) $budget rc=$RC" >> "$OUT/timings.txt"
  if [ "$RC" = 124 ] || [ "$RC" = 137 ]; then
    say FAIL "$name" "over its budget of ${budget} s: killed ($(elapsed)); tail: $(tail_of "$log")"
    settle
  fi
}
# after a killed step: its ranks end themselves (ZERO_BENCH_PARENT_PID); wait up to 20 s for the GPUs
settle() {
  [ "$MODE" = gpu ] || return 0
  for _ in $(seq 20); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0; sleep 1
  done
}
failed() { say FAIL "$1" "exit $RC; tail: $(tail_of "$2")"; }
# the report, the pack's lines, its timings and the logs, where they can be committed
write_report() {
  mkdir -p "$REPORT"
  step "$1" "$OUT/$1.log" "${ZB[@]}" report report.out="$REPORT/validate.xlsx" "store=$STORE"
  if ran; then
    if [ "$RC" = 0 ] && [ -s "$REPORT/validate.xlsx" ]; then
      say PASS "$1" "$REPORT/validate.{xlsx,csv,md}, the pack's lines, timings and logs ($(elapsed))"
    else failed "$1" "$OUT/$1.log"; fi
  fi
  cp "$OUT"/*.log "$OUT/pack.txt" "$OUT/timings.txt" "$REPORT/" 2>/dev/null
}
# search NAME ARGS...: one max-batch search under its budget; its verdicts come from the store
search() {
  local name=$1; shift
  # shellcheck disable=SC2086
  step "$name" "$OUT/$name.log" "${ZB[@]}" maxbatch $SEARCH "$@" hydra.run.dir="$OUT/$name" "store=$STORE"
  if ran; then say INFO "$name" "search exit $RC ($(elapsed))"; fi
}
# trial NAME ARGS...: one trial, PASS when it ran
trial() {
  local name=$1; shift
  step "$name" "$OUT/$name.log" "${ZB[@]}" "$@" hydra.run.dir="$OUT/$name" "store=$STORE"
  if ran; then if [ "$RC" = 0 ]; then say PASS "$name" "$* ($(elapsed))"; else failed "$name" "$OUT/$name.log"; fi; fi
}
# verdicts NAME [FILTER]: per search its boundary, its pool and the estimate against it (those matching FILTER)
verdicts() {
  step "$1" "$OUT/$1.log" "$PY" launch/validate_query.py "$STORE" all "$CAP_MIB" 15
  if ran; then if [ "$RC" = 0 ]; then relay < <(grep -E -- "${2:-.}" "$OUT/$1.log"); else failed "$1" "$OUT/$1.log"; fi; fi
}

if [ "$MODE" = cpu ]; then
  # the pipeline on CPU: a Llama-style model small enough for 2 CPU ranks, a per-rank RSS budget
  NGPU=0; HW="hardware=cpu"; DP=parallel=dp2; CAP="search.cpu_budget_gb=0.8"; CAP_MIB=-
  MODEL="model=llama-tiny model.seq_len=128 model.attention=sdpa"; DEVICE=cpu-$(uname -m)
else
  NGPU=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  HW="hardware=gpu"; DP=parallel=dp1; CAP="hardware.memory_mib=24576"; CAP_MIB=24576
  MODEL="model=hf model.hf_config=tests/data/hf/Qwen2.5-0.5B/config.json model.seq_len=1024 model.attention=sdpa"
  DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | head -n 1 | tr ' /' '__')
  DEVICE=${DEVICE:-unknown-gpu}
fi
REPORT="reports/gpu/$DEVICE"; [ "$MODE" = cpu ] && REPORT="$OUT/report"  # only a GPU's report is to be committed
REPORT=${PACK_REPORT_DIR:-$REPORT}
SEARCH="$HW $DP $MODEL $CAP steps.warmup=1 steps.timed=2"
echo "zero_bench GPU validation: $NGPU GPU(s), device $DEVICE, deadline ${BUDGET} s (step budgets x$SCALE), work in $OUT"

# -- the core: the GPUs, calibrate, the ZeRO-3 and FSDP2 searches, their verdicts, the report ------
if [ "$MODE" = gpu ]; then
  if [ "$NGPU" -lt 1 ]; then say FAIL gpu "nvidia-smi lists no GPU"; echo "passed $pass, failed $fail, skipped $skip"; exit 1; fi
  LAST=$((NGPU - 1))
  step gpu "$OUT/gpu.log" env CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES="$LAST" "$PY" launch/smoke_query.py - device "$LAST"
  if ran; then if [ "$RC" = 0 ]; then say INFO "mem-gpu$LAST" "$(tail -n 1 "$OUT/gpu.log")"; else failed gpu "$OUT/gpu.log"; fi; fi
else say SKIP gpu "--cpu: no GPU to read"; fi

step calibrate "$OUT/calibrate.log" "${ZB[@]}" calibrate $HW $DP "store=$STORE"
if ran && [ "$RC" = 0 ]; then
  say PASS calibrate "$(tail -n 1 "$OUT/calibrate.log") ($(elapsed)); every term: calibrate.log"
  step calibrated "$OUT/estimate.log" "${ZB[@]}" estimate $HW $DP $MODEL zero=1 "store=$STORE"
  if ran; then
    if [ "$RC" = 0 ] && grep -q "calibrated on" "$OUT/estimate.log"; then
      say PASS calibrated "$(grep -o 'calibrated on[^;]*' "$OUT/estimate.log" | head -n 1)"
    else say FAIL calibrated "the estimate does not use the calibration: $(head -c 300 "$OUT/estimate.log")"; fi
  fi
elif ran; then
  failed calibrate "$OUT/calibrate.log"
  timeout 60 "${ZB[@]}" doctor > "$OUT/doctor.log" 2>&1  # the first launch failed: what is missing here
  say INFO doctor "$(grep -c '^\[FIX\]' "$OUT/doctor.log") fix line(s): doctor.log"
fi

# ZeRO-3 on the last GPU: its last trial answers the smoke test's 1-GPU and NVML-mapping checks
if [ "$MODE" = gpu ]; then
  WANT=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$LAST" | tr -d ' ')
  CUDA_VISIBLE_DEVICES=$LAST search zero3 zero=3
  if [ "$RC" != 200 ]; then
    read -r n uuids tps nonzero <<<"$("$PY" launch/smoke_query.py "$STORE" last_ok 2>/dev/null | tail -n 1)"
    if [ "${n:-0}" = 1 ] && [ "${nonzero:-0}" = 1 ] && [ "${uuids:-}" = "$WANT" ]; then
      say PASS 1-gpu "CUDA_VISIBLE_DEVICES=$LAST: time/it ${tps}s on $uuids, nvidia-smi's GPU $LAST"
    else say FAIL 1-gpu "want one GPU, $WANT, peak > 0: the last ok trial reported ${n:-0}: ${uuids:--}, peak>0=${nonzero:-0}"; fi
    while read -r line; do say INFO mem-rank "$line"; done < <("$PY" launch/smoke_query.py "$STORE" gpu_mem 2>/dev/null | grep '^rank')
  fi
else search zero3 zero=3; fi

# shellcheck disable=SC2086
step fsdp2-check "$OUT/fsdp2_check.log" "${ZB[@]}" estimate $SEARCH engine=fsdp2 zero=3 "store=$STORE"
if ran; then
  if [ "$RC" = 0 ]; then search fsdp2 engine=fsdp2 zero=3
  else say SKIP fsdp2 "not for this model yet: $(grep -m1 -E '^[A-Za-z.]*(Error|Exception):|^zero_bench' "$OUT/fsdp2_check.log" | head -c 200)"; fi
fi

verdicts verdicts
write_report report

# -- then, as time allows: two GPUs, the recipes, the other ZeRO stages, the report again ---------
if [ "$NGPU" -ge 2 ]; then
  trial tp2 $HW model=gpt-tiny parallel=tp2 batch.micro=2 steps.warmup=1 steps.timed=2
  # Ulysses: each 16K-token sequence split over the two GPUs (parallel.sp=2), then the same run at
  # sp=1 (the worker gives both ranks the same tokens): bf16 losses and gradient norms within 1 %
  SP="$HW parallel=dp2 model=llama-tiny model.seq_len=16384 precision=bf16 zero=3 batch.micro=1 steps.warmup=1 steps.timed=2"
  trial ulysses $SP parallel.sp=2
  if [ "$RC" = 0 ]; then
    trial ulysses-sp1 $SP
    relay < <(timeout 60 "$PY" launch/validate_query.py "$STORE" ulysses 1)
  fi
  # shellcheck disable=SC2086
  step dp2 "$OUT/dp2.log" "${ZB[@]}" maxbatch $HW parallel=dp2 $MODEL $CAP zero=3 steps.warmup=1 steps.timed=2 \
    hydra.run.dir="$OUT/dp2" "store=$STORE"
  if ran; then
    say INFO dp2 "2-rank ZeRO-3 search exit $RC ($(elapsed))"
    relay < <(timeout 60 "$PY" launch/validate_query.py "$STORE" all "$CAP_MIB" 15 | grep 'dp2 zero3')
  fi
  EP2="$HW parallel=dp2 parallel.ep=2 model=moe-tiny precision=bf16 batch.micro=2 steps.warmup=1 steps.timed=2"
  trial ep2-zero2 $EP2 zero=2
  trial ep2-fsdp2 $EP2 engine=fsdp2 zero=3 recompute=op
  # ZeRO++'s quantized all-gathers need 2 ranks and CUDA (refused on CPU); qgZ would need 2 nodes
  trial zeropp2 $HW parallel=dp2 model=llama-tiny precision=bf16 zero=3 zeropp.qwz=true zeropp.hpz=2 \
    batch.micro=2 steps.warmup=1 steps.timed=2
elif [ "$MODE" = gpu ]; then say SKIP 2-gpu "one GPU only"; fi

if [ "$MODE" = gpu ]; then
  # the longest sequence with ALST's memory savers on one GPU: under an emulated 3 GiB card the
  # estimate stops llama-tiny (ZeRO-1, bf16) near 10K tokens without them, 18K tiled, 35K offloaded,
  # 53K with both; to 4,096 tokens and one timed step, so its ~4 fresh trials fit the budget
  SEQCAP=3072
  step maxseq-tiled "$OUT/maxseq-tiled.log" "${ZB[@]}" maxseq $HW $DP model=llama-tiny precision=bf16 zero=1 \
    tiled_mlp=auto recompute=full recompute_offload=true hardware.memory_mib=$SEQCAP search.seq_granularity=4096 \
    steps.warmup=1 steps.timed=1 hydra.run.dir="$OUT/maxseq-tiled" "store=$STORE"
  if ran; then
    say INFO maxseq-tiled "search exit $RC ($(elapsed))"
    relay < <(timeout 60 "$PY" launch/validate_query.py "$STORE" all "$SEQCAP" 15 | grep 'recompute_offload')
  fi
fi

if [ "$MODE" = gpu ]; then  # one trial each of the 2026 recipes (their memory beside the estimate: the report)
  RECIPE="$HW $DP batch.micro=2 steps.warmup=1 steps.timed=2"
  while read -r name args; do
    # shellcheck disable=SC2086
    trial "$name" $RECIPE $args
  done <<'RECIPES'
op-zero1 model=llama-tiny zero=1 precision=bf16 recompute=op
moe-fsdp2-op model=moe-tiny engine=fsdp2 zero=3 precision=bf16 recompute=op
bf16-states model=llama-tiny zero=2 precision=bf16 states=bf16
chunked-loss model=llama-tiny zero=3 precision=bf16 loss=chunked
op-fsdp2 model=llama-tiny engine=fsdp2 zero=3 precision=bf16 recompute=op
moe-zero2 model=moe-tiny zero=2 precision=bf16
zeropp-qwz model=llama-tiny zero=3 precision=bf16 zeropp.qwz=true
RECIPES
fi

extra=0
for z in 1 2 0; do
  search "zero$z" "zero=$z"
  [ "$RC" = 200 ] || extra=1
done
[ "$extra" = 1 ] && verdicts verdicts2 ' zero[012] '
write_report final-report

echo "passed $pass, failed $fail, skipped $skip in $(elapsed) (deadline $BUDGET s); report in $REPORT" | tee -a "$OUT/pack.txt"
cp "$OUT/pack.txt" "$OUT/timings.txt" "$REPORT/" 2>/dev/null
[ "$fail" = 0 ]
