#!/bin/bash
# device call A (session 28; session 27's builds were lost with its machine): large-1024 (fp16 on disk, served in
# bf16) and its AOTInductor and TileLang parts built at once under setsid, decision suite at 256 (a start does not
# depend on it); waits for both, then runs callB_s28.sh (merge, the TileLang-best copy, hand-over starts) with the
# seconds this call has left; a later call B runs what is left.
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
L=/tmp/s28; mkdir -p $L; S=benchmarks/results/gpu_h200_start/s28
nproc; uptime; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
B="python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 target=sm_90 stages.onnx=false stages.inductor_cache=false verify.tolerance.decisions=256"
part() {  # name, overrides
  setsid bash -c "$B output_dir=/tmp/b-$1 $2 > $L/build_$1_s28.log 2>&1; echo build rc \$? >> $L/build_$1_s28.log" \
    < /dev/null > /dev/null 2>&1 &
}
part aoti "stages.tilelang=false"
part tl "stages.aoti=false"
done2() { [ $(grep -l "build rc" $L/build_*_s28.log 2>/dev/null | wc -l) -eq 2 ]; }
while ! done2 && [ $(left) -gt 5 ]; do sleep 5; done
el "waited"; for f in $L/build_*_s28.log; do echo "== $f"; grep -E "^(ok|failed|skipped) |build rc|bundle written" $f; done
uptime; cp $L/*.log $OUT/ 2>/dev/null
if done2 && [ $(left) -gt 150 ]; then BUDGET=$(left) bash $S/callB_s28.sh; fi
ls $OUT
