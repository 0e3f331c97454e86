#!/usr/bin/env bash
# The GPU validation pack: one command on a GPU machine, meant to take at most 10 minutes on one GPU.
#
#   bash launch/gpu_validate.sh          # PYTHON=... to choose the interpreter (default: python)
#   bash launch/gpu_validate.sh --cpu    # the same pipeline on CPU (a check of the pack itself)
#
# One PASS / FAIL / SKIP / INFO line per check, then a summary; exit 1 if any check failed.
#   1. smoke        launch/gpu_smoke.sh: doctor, a 1-GPU trial, 2-GPU NCCL trial, a CUDA-OOM search in
#                   one pool of forked trials, NVML's device mapping, the memory figures side by side
#   2. calibrate    `zero_bench calibrate`: this machine's fixed terms, measured and cached; the estimate
#                   afterwards says "calibrated on <device>"
#   3. searches     Qwen2.5-0.5B (a Llama-style model: GQA, SwiGLU, RMSNorm, RoPE; its real config.json)
#                   at seq 1024 under an emulated 24 GiB card: max-batch searches for ZeRO 0-3 and FSDP2
#                   (zero=3), each boundary confirmed fresh; where an engine refuses the model: SKIP + why
#   4. estimate     per search at its boundary, the estimate's terms beside what was measured (the
#                   report's own comparison): the device peak within 15 % passes, the rest is INFO
#   5. report       reports/gpu/<device>/validate.{xlsx,csv,md}: commit them
#   6. 2+ GPUs      tp=2 (megatron's tensor parallelism over NCCL) and a 2-rank ZeRO-3 search; the
#                   mixture of experts at ep=2 (megatron's alltoall dispatcher over NCCL) in both engines
#   7. recipes      one trial each of the 2026 recipes never run on a GPU before: per-op recompute
#                   (torch's selective checkpoint with CUDA's flash kernels) in both engines, pure bf16
#                   states, the chunked loss, the mixture of experts (ep 1)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
CPU=0; [ "${1:-}" = --cpu ] && CPU=1
OUT=$(mktemp -d "${TMPDIR:-/tmp}/zero_bench_validate.XXXXXX")
STORE="$OUT/validate.sqlite"
T0=$(date +%s)
pass=0; fail=0; skip=0
say() { printf '%-5s %-10s %s\n' "$1" "$2" "$3"; count "$1"; }
count() { case $1 in PASS) pass=$((pass+1));; FAIL) fail=$((fail+1));; SKIP) skip=$((skip+1));; esac; }
# a query's verdict lines (DeepSpeed's import may log to stdout too); `relay < <(...)` counts them in this shell
relay() { while read -r verdict name rest; do case $verdict in PASS|FAIL|SKIP|INFO) say "$verdict" "$name" "$rest";; esac; done; }
zb() { "$PY" -m zero_bench "$@" "store=$STORE"; }
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }

if [ "$CPU" = 1 ]; then
  # the pipeline on CPU: a Llama-style model small enough for 2 CPU ranks, a per-rank RSS budget
  NGPU=0; HW="hardware=cpu"; DP=parallel=dp2; CAP="search.cpu_budget_gb=0.8"
  MODEL="model=llama-tiny model.seq_len=128"; DEVICE=cpu-$(uname -m)
else
  NGPU=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  HW="hardware=gpu"; DP=parallel=dp1; CAP="hardware.memory_mib=24576"
  MODEL="model=hf model.hf_config=tests/data/hf/Qwen2.5-0.5B/config.json model.seq_len=1024"
  DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | head -n 1 | tr ' /' '__')
  DEVICE=${DEVICE:-unknown-gpu}
fi
REPORT="reports/gpu/$DEVICE"; [ "$CPU" = 1 ] && REPORT="$OUT/report"  # only a GPU's report is to be committed
echo "zero_bench GPU validation: $NGPU GPU(s), device $DEVICE, work in $OUT"

# 1. the smoke test (its own PASS/FAIL lines, prefixed)
if [ "$CPU" = 1 ]; then say SKIP smoke "--cpu: the smoke test needs a GPU"
else
  PYTHON="$PY" bash launch/gpu_smoke.sh > "$OUT/smoke.log" 2>&1
  grep -E '^(PASS|FAIL|SKIP|INFO) ' "$OUT/smoke.log" | while read -r v n rest; do echo "$v smoke:$n $rest"; done
  read -r sp sf <<<"$(grep -c '^PASS ' "$OUT/smoke.log") $(grep -c '^FAIL ' "$OUT/smoke.log")"
  [ "$sf" = 0 ] && say PASS smoke "$sp check(s) passed ($(elapsed))" || say FAIL smoke "$sf check(s) failed; $OUT/smoke.log"
fi

# 2. calibrate, then the estimate must say it uses the calibration
if zb calibrate $HW $DP > "$OUT/calibrate.log" 2>&1; then
  say PASS calibrate "$(tail -n 1 "$OUT/calibrate.log") ($(elapsed)); every term: $OUT/calibrate.log"
  if zb estimate $HW $DP $MODEL zero=1 > "$OUT/estimate.log" 2>&1 && grep -q "calibrated on" "$OUT/estimate.log"; then
    say PASS calibrated "$(grep -o 'calibrated on[^;)]*' "$OUT/estimate.log" | head -n 1)"
  else say FAIL calibrated "the estimate does not use the calibration: $(head -c 300 "$OUT/estimate.log")"; fi
else say FAIL calibrate "exit $?; tail: $(tail -c 300 "$OUT/calibrate.log")"; fi

# 3. max-batch searches: DeepSpeed ZeRO 0-3 (one sweep, one pool per search), FSDP2
SEARCH="$HW $DP $MODEL $CAP steps.warmup=1 steps.timed=2"
zb maxbatch -m $SEARCH zero=0,1,2,3 hydra.sweep.dir="$OUT/zero" > "$OUT/zero.log" 2>&1
say INFO sweep "ZeRO 0-3 exit $? ($(elapsed))"
if zb estimate $SEARCH engine=fsdp2 zero=3 > "$OUT/fsdp2_check.log" 2>&1; then
  zb maxbatch $SEARCH engine=fsdp2 zero=3 hydra.run.dir="$OUT/fsdp2" > "$OUT/fsdp2.log" 2>&1
  say INFO fsdp2 "exit $? ($(elapsed))"
else say SKIP fsdp2 "not for this model yet: $(grep -m1 -E '^[A-Za-z.]*(Error|Exception):|^zero_bench' "$OUT/fsdp2_check.log" | head -c 200)"; fi
relay < <("$PY" launch/validate_query.py "$STORE" searches)

# 4. the estimate against what the searches measured, term by term
relay < <("$PY" launch/validate_query.py "$STORE" terms 15)

# 6. two GPUs: tensor parallelism and a 2-rank ZeRO-3 search (before the report, which shows them too)
if [ "$NGPU" -ge 2 ]; then
  TINY="$HW model=gpt-tiny batch.micro=2 steps.warmup=1 steps.timed=2"
  zb $TINY parallel=tp2 hydra.run.dir="$OUT/tp2" > "$OUT/tp2.log" 2>&1 \
    && say PASS tp2 "gpt-tiny tp=2 over NCCL ($(elapsed))" || say FAIL tp2 "exit $?; tail: $(tail -c 300 "$OUT/tp2.log")"
  zb maxbatch $HW parallel=dp2 $MODEL $CAP zero=3 steps.warmup=1 steps.timed=2 hydra.run.dir="$OUT/dp2" > "$OUT/dp2.log" 2>&1
  say INFO dp2 "2-rank ZeRO-3 search exit $? ($(elapsed))"
  relay < <("$PY" launch/validate_query.py "$STORE" searches | grep 'dp2 zero3')
elif [ "$CPU" = 0 ]; then say SKIP 2-gpu "one GPU only"; fi

# 7. the recipes, one trial each (their memory beside the estimate is in the report)
if [ "$CPU" = 0 ]; then
  RECIPE="$HW $DP batch.micro=2 steps.warmup=1 steps.timed=2"
  while read -r name args; do
    zb $RECIPE $args hydra.run.dir="$OUT/$name" < /dev/null > "$OUT/$name.log" 2>&1 \
      && say PASS "$name" "$args ($(elapsed))" || say FAIL "$name" "exit $?; tail: $(tail -c 300 "$OUT/$name.log")"
  done <<'RECIPES'
op-zero1 model=llama-tiny zero=1 precision=bf16 recompute=op
op-fsdp2 model=llama-tiny engine=fsdp2 zero=3 precision=bf16 recompute=op
bf16-states model=llama-tiny zero=2 precision=bf16 states=bf16
chunked-loss model=llama-tiny zero=3 precision=bf16 loss=chunked
moe-zero2 model=moe-tiny zero=2 precision=bf16
moe-fsdp2-op model=moe-tiny engine=fsdp2 zero=3 precision=bf16 recompute=op
RECIPES
  if [ "$NGPU" -ge 2 ]; then
    for args in "zero=2" "engine=fsdp2 zero=3 recompute=op"; do
      zb $HW parallel=dp2 parallel.ep=2 model=moe-tiny precision=bf16 batch.micro=2 steps.warmup=1 steps.timed=2 \
        $args hydra.run.dir="$OUT/ep2-${args//[ =]/_}" < /dev/null > "$OUT/ep2.log" 2>&1 \
        && say PASS ep2 "moe-tiny ep=2 $args ($(elapsed))" || say FAIL ep2 "$args exit $?; tail: $(tail -c 300 "$OUT/ep2.log")"
    done
  fi
fi

# 5. the report a person reads, where it can be committed
mkdir -p "$REPORT"
if zb report report.out="$REPORT/validate.xlsx" > "$OUT/report.log" 2>&1 && [ -s "$REPORT/validate.xlsx" ]; then
  cp "$OUT"/*.log "$REPORT/" 2>/dev/null
  say PASS report "$REPORT/validate.{xlsx,csv,md} and the logs ($(elapsed))"
else say FAIL report "exit $?; tail: $(tail -c 300 "$OUT/report.log")"; fi

echo "passed $pass, failed $fail, skipped $skip in $(elapsed); report in $REPORT"
[ "$fail" = 0 ]
