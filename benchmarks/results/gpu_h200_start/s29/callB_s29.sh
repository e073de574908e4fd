#!/bin/bash
# device call B (session 29): the later starts of call A's kind again, several of them, for a median rather than one
# sample; a second first start in an empty cache without the probe child started ahead (LAYA_AOT_PROBE_AHEAD=0: with
# a shipped verdict that child is never used); and where a later start's imports go (python -X importtime).
# large-1024 (fp16 on disk, served in bf16), AOTInductor alone (stages.tilelang=false: the hand-over was measured
# in call A).
T0=$(date +%s)
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
L=/tmp/s29b; mkdir -p $L; C=/tmp/laya-large-1024-fp16
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('$C','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
python3 -m laya_aot.cli build checkpoint.path=$C target=sm_90 stages.onnx=false stages.tilelang=false \
  stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=/tmp/b-a > $L/build_b_s29.log 2>&1
el "build rc $?"; grep -E "^(ok|failed|skipped) |bundle written" $L/build_b_s29.log; cp $L/build_b_s29.log $OUT/
run() {  # tag starts [env]
  if [ -f /tmp/b-a/bundle.json ] && [ $(left) -gt 40 ]; then
    env $3 timeout $(( $(left) - 25 )) python3 benchmarks/handover_start.py --ckpt $C --bundle /tmp/b-a --out $L \
      --cache /tmp/cache$1 --starts $2 --repeats 1 --modes aoti --tag $1 > $L/handover$1.log 2>&1
    el "$1 rc $?"; cat $L/handover$1.md 2>/dev/null || tail -3 $L/handover$1.log
    cp $L/handover$1.json $L/handover$1.md $OUT/ 2>/dev/null; tail -1 $L/handover$1.log
  fi
}
run _later_s29 6
run _noahead_s29 1 LAYA_AOT_PROBE_AHEAD=0
if [ -d /tmp/cache_later_s29 ] && [ $(left) -gt 20 ]; then
  LAYA_AOT_CACHE_DIR=/tmp/cache_later_s29 timeout 15 python3 -X importtime benchmarks/start_once.py bundle $C /tmp/b-a cuda \
    2> $OUT/importtime_later_s29.txt; el "importtime rc $?"
  sort -t'|' -k2 -n -r $OUT/importtime_later_s29.txt | head -25
fi
ls $OUT
