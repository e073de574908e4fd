#!/bin/bash
# device call 3 of session 31: large-1024 (fp16 on disk), AOTInductor alone. Call 2 (`call_s31.sh`) handed the
# package its constants while their bytes were being written, and torch's `load_constants` then took 1.1 s
# (0.3-0.5 s alone): this tree ("new") hands them over before the copy starts, then writes them beside the first
# call at the smoke check's shape (`kinds.Incoming`, `LoadEnv.early_calls`).
# 1. Starts as a user's process runs them (`benchmarks/start_once.py`: seconds from the kernel's process start to
#    the first answer), new against main 55a2c0b ("old", `.ab_old/`, carried), each with its own laya-aot cache:
#    one first start each, then later starts interleaved new/old; the new tree's `load_stats` to a JSON-lines file.
# 2. `investigations/first_calls.py` (call 2's timed out after 120 s without printing: it now prints as it goes).
# 3. Where gdb runs: native stacks of `load_constants` in a loop (`investigations/lc_loop.py`).
T0=$(date +%s)
el() { echo "[call2_s31] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 570 - ($(date +%s) - T0) )); }
L=/tmp/s31b; mkdir -p $L; C=/tmp/laya-large-1024-fp16; B=/tmp/b-s31b
(which gdb perf py-spy; nproc) > $OUT/tools_s31.txt 2>&1
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('$C','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
python3 -m laya_aot.cli build checkpoint.path=$C target=sm_90 stages.onnx=false stages.tilelang=false \
  stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=$B > $L/build2_s31.log 2>&1
el "build rc $?"; grep -E "^(ok|failed|skipped) |bundle written" $L/build2_s31.log; cp $L/build2_s31.log $OUT/
[ -f $B/bundle.json ] || exit 1
one() {  # label cache command...
  local t; t=$( { LAYA_AOT_CACHE_DIR=$2 LAYA_AOT_PRINT_FIRST_ANSWER=1 timeout 60 "${@:3}" 2>&1 1>/dev/null; } \
    | grep -o 'first answer [0-9.]*' | grep -o '[0-9.]*$')
  echo "$1 ${t:-failed}" | tee -a $OUT/starts2_s31.txt
}
NEW="env LAYA_AOT_LOAD_STATS_TO=$OUT/load_stats2_s31.jsonl python3 benchmarks/start_once.py bundle $C $B cuda"
OLD="env PYTHONPATH=/tmp/site:$PWD/.ab_old python3 .ab_old/benchmarks/start_once.py bundle $C $B cuda"
one new_first /tmp/cache_new $NEW
one old_first /tmp/cache_old $OLD
for r in 1 2 3 4 5 6 7 8; do
  [ $(left) -lt 75 ] && break
  one new /tmp/cache_new $NEW
  one old /tmp/cache_old $OLD
done
el "starts done"
T=$(( $(left) - 25 )); [ $T -gt 45 ] && T=45
[ $T -gt 10 ] && { timeout $T python3 benchmarks/investigations/first_calls.py $B $C > $OUT/first_calls2_s31.out 2>&1
  el "first_calls rc $?"; }
if command -v gdb > /dev/null && [ $(left) -gt 25 ]; then
  python3 benchmarks/investigations/lc_loop.py $B $C --seconds 14 > $L/lc.out 2>&1 &
  for i in $(seq 40); do grep -q '^load_constants' $L/lc.out 2>/dev/null && break; sleep 0.25; done
  P=$(grep -o '^PID [0-9]*' $L/lc.out | grep -o '[0-9]*$')
  for i in 1 2 3 4 5 6; do
    [ -n "$P" ] && timeout 8 gdb -p $P -batch -ex "thread apply all bt 24" 2>/dev/null | grep -E '^(#|Thread)' \
      | head -120 >> $OUT/lc_stacks_s31.txt; echo "----" >> $OUT/lc_stacks_s31.txt; sleep 0.7
  done
  wait; cp $L/lc.out $OUT/lc_loop_s31.out; el "gdb done"
fi
el done
