#!/bin/bash
# device call 2 of session 31 (after `start_tail.sh`, call 1): large-1024 (fp16 on disk), AOTInductor alone.
# 1. `investigations/first_calls.py` once: does torch 2.11 read user-managed constants in place (the new start hands
#    them over unwritten), does its loader / a first call let another thread run, which shapes pay a first call.
# 2. Starts as a user's process runs them (`benchmarks/start_once.py`, seconds from the kernel's process start to
#    the first answer), this tree ("new": constants handed over before their bytes, first call beside the copy)
#    against main 55a2c0b ("old", `.ab_old/`, carried), each with its own laya-aot cache: one first start each,
#    then later starts interleaved new/old. The new tree's `load_stats` go to load_stats_s31.jsonl.
# 3. If time is left: `handover_start.py`, three starts of the new tree, the three realistic calls after each.
T0=$(date +%s)
el() { echo "[call_s31] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
L=/tmp/s31; mkdir -p $L; C=/tmp/laya-large-1024-fp16; B=/tmp/b-s31
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('$C','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
python3 -m laya_aot.cli build checkpoint.path=$C target=sm_90 stages.onnx=false stages.tilelang=false \
  stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=$B > $L/build_s31.log 2>&1
el "build rc $?"; grep -E "^(ok|failed|skipped) |bundle written" $L/build_s31.log; cp $L/build_s31.log $OUT/
[ -f $B/bundle.json ] || exit 1
timeout 120 python3 benchmarks/investigations/first_calls.py $B $C > $L/first_calls.out 2>&1
el "first_calls rc $?"; tail -1 $L/first_calls.out > $OUT/first_calls_s31.json; tail -c 1500 $L/first_calls.out
one() {  # label cache command...
  local t; t=$( { LAYA_AOT_CACHE_DIR=$2 LAYA_AOT_PRINT_FIRST_ANSWER=1 timeout 60 "${@:3}" 2>&1 1>/dev/null; } \
    | grep -o 'first answer [0-9.]*' | grep -o '[0-9.]*$')
  echo "$1 ${t:-failed}" | tee -a $OUT/starts_s31.txt
}
export LAYA_AOT_LOAD_STATS_TO=$OUT/load_stats_s31.jsonl
NEW="python3 benchmarks/start_once.py bundle $C $B cuda"
OLD="env PYTHONPATH=/tmp/site:$PWD/.ab_old python3 .ab_old/benchmarks/start_once.py bundle $C $B cuda"
one new_first /tmp/cache_new $NEW
one old_first /tmp/cache_old $OLD
for r in 1 2 3 4 5 6; do
  [ $(left) -lt 120 ] && break
  one new /tmp/cache_new $NEW
  one old /tmp/cache_old $OLD
done
el "starts done"
if [ $(left) -gt 70 ]; then
  timeout $(( $(left) - 10 )) python3 benchmarks/handover_start.py --ckpt $C --bundle $B --out $L \
    --cache /tmp/cache_hs --starts 3 --repeats 5 --modes aoti --tag _s31 > $L/handover_s31.log 2>&1
  el "handover_start rc $?"; cat $L/handover_s31.md 2>/dev/null || tail -3 $L/handover_s31.log
  cp $L/handover_s31.json $L/handover_s31.md $OUT/ 2>/dev/null
fi
el done
