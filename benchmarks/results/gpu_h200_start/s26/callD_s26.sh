#!/bin/bash
# device call D (session 26): calls A-B's large-1024 builds were lost (the machine went back between calls B and C
# while I wrote call B: idle longer than its 30 s). With the 600 s left, the hand-over on the GPU with the project's
# tiny checkpoint: its AOTInductor and TileLang parts built at once, merged, the copy with TileLang given the best
# mix (edit_mix.py), then starts alternating the hand-over, prefer="aoti" and handover=False (handover_start.py)
T0=$(date +%s)
el() { echo "[callD] $(( $(date +%s) - T0 )) s: $*"; }
git log --oneline -1 2>/dev/null; nproc; uptime
S=benchmarks/results/gpu_h200_start/s26; L=/tmp/s26; mkdir -p $L
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/ck-tiny','tiny',seed=0)" > $L/ckpt.log 2>&1
B="python3 -m laya_aot.cli build checkpoint.path=/tmp/ck-tiny target=sm_90 stages.onnx=false stages.inductor_cache=false"
$B output_dir=/tmp/t-aoti stages.tilelang=false > $L/build_tiny_aoti_s26.log 2>&1 &
$B output_dir=/tmp/t-tl stages.aoti=false > $L/build_tiny_tl_s26.log 2>&1 &
wait; el builds; grep -hE "^(ok|failed|skipped) |bundle written" $L/build_tiny_*_s26.log
python3 -m laya_aot.cli merge /tmp/t-m /tmp/t-aoti /tmp/t-tl > $L/merge_tiny_s26.log 2>&1; echo "merge rc $?" >> $L/merge_tiny_s26.log
cp -al /tmp/t-m /tmp/t-e && python3 $S/edit_mix.py /tmp/t-e tilelang >> $L/merge_tiny_s26.log 2>&1
python3 -m laya_aot.cli inspect /tmp/t-e > $L/inspect_tiny_e_s26.txt 2>&1
el merged; cat $L/merge_tiny_s26.log $L/inspect_tiny_e_s26.txt
timeout $(( 400 - ($(date +%s) - T0) )) python3 benchmarks/handover_start.py --ckpt /tmp/ck-tiny --bundle /tmp/t-e \
  --out $L --starts 2 --repeats 5 --modes handover,aoti,wait --tag _tiny_tl_s26 > $L/handover_tiny_tl_s26.log 2>&1
el "handover rc $?"; cat $L/handover_tiny_tl_s26.md
python3 - <<'PY'
import json; d = json.load(open("/tmp/s26/handover_tiny_tl_s26.json"))
for r in d["runs"]:
    print(r["mode"], r.get("first_answer_s"), r.get("handover"), r.get("compile_counters"))
PY
cd $L && tar -czf $OUT/callD.tgz *.log *.txt *.json *.md 2>/dev/null; cp $L/handover_tiny_tl_s26.* $OUT/ 2>/dev/null; uptime
