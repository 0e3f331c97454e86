#!/usr/bin/env bash
# The first run on a GPU machine (about 10 minutes): does zero_bench's GPU path work here?
# launch/gpu_validate.sh (within 8 minutes) does not run it: it folds its checks into its own steps
# (the 1-GPU trial and NVML mapping into its ZeRO-3 search's last trial, the CUDA-OOM search into
# every search's pool and OOM verdicts, the memory lines into its first step). This script stays for
# a machine where only these checks are wanted, one after the other.
#
#   bash launch/gpu_smoke.sh            # PYTHON=... to choose the interpreter (default: python)
#
# One PASS / FAIL / SKIP line per check, then a summary; exit 1 if any check failed.
#   1. doctor           what this machine has (informational, never fails the smoke test)
#   2. 1-GPU trial      gpt-tiny, dp=1: a trial runs and reports time/it and GPU memory
#   3. 2-GPU trial      gpt-tiny, dp=2 over NCCL, where the machine has 2 GPUs
#   4. CUDA OOM search  gpt-small, dp=1, an emulated 4096 MiB card: a real CUDA OOM bounds the search,
#                       the boundary is confirmed fresh, memory is reported against 4096 MiB; its
#                       trials are children forked from one pool whose parents never initialized CUDA
#   5. NVML mapping     CUDA_VISIBLE_DEVICES=<last GPU>: the trial ran on that GPU (nvidia-smi's UUID)
#                       and the report names exactly that one
#   6. GPU memory       INFO lines, per GPU with a 1 GiB tensor alive: nvidia-smi's used next to NVML
#                       v1 and v2 used, CUDA's total/free, torch's reserved/allocated and what is
#                       outside the allocator; and per rank of the 1- and 2-GPU trials what the rank
#                       recorded. Which figure equals nvidia-smi's "used" (expected: NVML v2's)?
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/zero_bench_smoke.XXXXXX")
STORE="$OUT/smoke.sqlite"
pass=0; fail=0; skip=0
say() { printf '%-5s %-16s %s\n' "$1" "$2" "$3"; case $1 in PASS) pass=$((pass+1));; FAIL) fail=$((fail+1));; SKIP) skip=$((skip+1));; esac; }
zb() { "$PY" -m zero_bench "$@" "store=$STORE"; }
query() {  # what a check compares, from the store (launch/smoke_query.py says what each prints)
  "$PY" launch/smoke_query.py "$STORE" "$@"
}

NGPU=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
echo "zero_bench GPU smoke test: $NGPU GPU(s), results in $OUT"
zb doctor > "$OUT/doctor.log" 2>&1
say INFO doctor "$(grep -c '^\[FIX\]' "$OUT/doctor.log") fix line(s); see $OUT/doctor.log"
if [ "$NGPU" -lt 1 ]; then
  say FAIL gpu "nvidia-smi lists no GPU"; echo "passed $pass, failed $fail, skipped $skip"; exit 1
fi

TINY="model=gpt-tiny hardware=gpu batch.micro=2 steps.warmup=2 steps.timed=3"
if zb $TINY parallel=dp1 hydra.run.dir="$OUT/one" > "$OUT/one.log" 2>&1; then
  read -r n uuids tps nonzero <<<"$(query last_ok)"
  [ "$n" = 1 ] && [ "$nonzero" = 1 ] && say PASS 1-gpu "time/it ${tps}s on $uuids" || say FAIL 1-gpu "devices=$n peak>0=$nonzero"
  query gpu_mem | while read -r line; do say INFO mem-1gpu "$line"; done
else say FAIL 1-gpu "exit $?; tail: $(tail -c 300 "$OUT/one.log")"; fi

if [ "$NGPU" -ge 2 ]; then
  if zb $TINY parallel=dp2 hydra.run.dir="$OUT/two" > "$OUT/two.log" 2>&1; then
    read -r n uuids tps nonzero <<<"$(query last_ok)"
    [ "$n" = 2 ] && say PASS 2-gpu "NCCL dp=2, time/it ${tps}s on $uuids" || say FAIL 2-gpu "reported $n devices"
    query gpu_mem | while read -r line; do say INFO mem-2gpu "$line"; done
  else say FAIL 2-gpu "exit $?; tail: $(tail -c 300 "$OUT/two.log")"; fi
else say SKIP 2-gpu "one GPU only"; fi

if zb maxbatch model=gpt-small parallel=dp1 hardware=gpu hardware.memory_mib=4096 search.max=1024 \
     steps.warmup=1 steps.timed=2 hydra.run.dir="$OUT/oom" > "$OUT/oom.log" 2>&1; then
  read -r status lo hi real tot forked fresh <<<"$(query search)"
  pools=$(ls -d "$OUT"/oom/pool/pool* 2>/dev/null | wc -l)
  refused=$(cat "$OUT"/oom/pool/pool*/refused 2>/dev/null | head -c 200)
  # one pool that served: it did not refuse, and every trial was forked from it (a refusing pool
  # leaves its folder behind while every trial is launched fresh)
  if [ "$status" = done ] && [ "$real" -ge 1 ] && [ "$tot" = 4096 ] && [ "$pools" = 1 ] && [ -z "$refused" ] \
     && [ "$forked" -ge 1 ] && [ "$fresh" = 0 ]; then
    say PASS cuda-oom "max micro $lo, fails at $hi (fresh), $real real CUDA OOM(s), reported against $tot MiB, one pool: $forked trial(s) forked, $fresh launched"
  else say FAIL cuda-oom "status=$status micro=$lo..$hi real_ooms=$real total=$tot MiB pools=$pools forked=$forked launched=$fresh refused=${refused:-no}"; fi
else say FAIL cuda-oom "exit $?; tail: $(tail -c 300 "$OUT/oom.log")"; fi

LAST=$((NGPU - 1))
WANT=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$LAST" | tr -d ' ')
if CUDA_VISIBLE_DEVICES=$LAST zb $TINY parallel=dp1 hydra.run.dir="$OUT/last" > "$OUT/last.log" 2>&1; then
  read -r n uuids tps nonzero <<<"$(query last_ok)"
  [ "$n" = 1 ] && [ "$uuids" = "$WANT" ] && say PASS nvml-mapping "CUDA_VISIBLE_DEVICES=$LAST ran and reported $uuids" \
    || say FAIL nvml-mapping "want $WANT, reported $n device(s): $uuids"
else say FAIL nvml-mapping "exit $?; tail: $(tail -c 300 "$OUT/last.log")"; fi

# per GPU, outside any trial: which figure is nvidia-smi's "used"?
for i in $(seq 0 "$LAST"); do
  line=$(CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$i "$PY" launch/smoke_query.py - device "$i" 2>&1 | tail -n 1)
  say INFO "mem-gpu$i" "$line"
done

echo "passed $pass, failed $fail, skipped $skip"
[ "$fail" = 0 ]
