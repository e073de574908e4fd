#!/bin/bash
# (edit_mix.py: session 26's script; this call ran a byte-identical copy, md5 321ce906, since removed)
# device call C (session 28; call A's builds were lost when the machine went back between calls A and B, and call B
# found a bare machine): the whole measurement in one call. large-1024 (fp16 on disk, served in bf16), one build
# with both the AOTInductor and TileLang artifacts (decision suite at 256: a start does not depend on it); a copy
# whose manifest gives TileLang the best mix (edit_mix.py), and starts of that copy alternating load's default
# (the hand-over) and prefer="aoti", then handover=False (TileLang's own start), with what this call has left.
T0=$(date +%s)
el() { echo "[callC] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 590 - ($(date +%s) - T0) )); }
L=/tmp/s28; mkdir -p $L; S=benchmarks/results/gpu_h200_start/s28
nproc; uptime; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 target=sm_90 stages.onnx=false \
  stages.inductor_cache=false verify.tolerance.decisions=256 output_dir=/tmp/b-m > $L/build_s28.log 2>&1
el "build rc $?"; grep -E "^(ok|failed|skipped) |bundle written" $L/build_s28.log; cp $L/build_s28.log $OUT/
python3 -m laya_aot.cli inspect /tmp/b-m > $L/inspect_built_s28.txt 2>&1
cp -al /tmp/b-m /tmp/b-e && python3 benchmarks/results/gpu_h200_start/s26/edit_mix.py /tmp/b-e tilelang > $L/edit_s28.log 2>&1
python3 -m laya_aot.cli inspect /tmp/b-e > $L/inspect_edit_s28.txt 2>&1
cat $L/edit_s28.log; tail -4 $L/inspect_built_s28.txt; tail -4 $L/inspect_edit_s28.txt; cp $L/*.txt $L/edit_s28.log $OUT/
if [ -f /tmp/b-e/bundle.json ] && [ $(left) -gt 40 ]; then
  timeout $(( $(left) - 8 )) python3 benchmarks/handover_start.py --ckpt /tmp/laya-large-1024-fp16 --bundle /tmp/b-e \
    --out $L --starts 2 --repeats 5 --modes handover,aoti,wait --tag _large_tl_s28 > $L/handover_large_tl_s28.log 2>&1
  el "handover rc $?"; cat $L/handover_large_tl_s28.md 2>/dev/null || grep -E '^\{' $L/handover_large_tl_s28.log
fi
cp $L/handover_large_tl_s28.* $OUT/ 2>/dev/null; ls $OUT; uptime
