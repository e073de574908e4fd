#!/bin/bash
# device call A (session 27): (1) where a fresh process's seconds go before laya's module exists on this GPU host
# (benchmarks/investigations/eager_module_start.py, tiny checkpoint: TileLang's own start spent 10.4 s there in
# session 26 against 2.2 s on a CPU machine); (2) large-1024 (fp16 on disk, served in bf16) and its AOTInductor and
# TileLang parts built at once under setsid (they go on between calls on this machine), decision suite at 256 (a
# start does not depend on it); this call waits for them up to 570 s and copies the logs.
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
L=/tmp/s27; mkdir -p $L
nproc; uptime; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/ck-tiny','tiny',seed=0)" > $L/ckpt_tiny.log 2>&1
timeout 150 python3 benchmarks/investigations/eager_module_start.py --ckpt /tmp/ck-tiny --out $L --device cuda --tag _h200_s27 > $L/eager_module_start_s27.log 2>&1
el "eager_module_start rc $?"; cat $L/eager_module_start_h200_s27.md
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $L/ckpt.log 2>&1
el checkpoint
B="python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 target=sm_90 stages.onnx=false stages.inductor_cache=false verify.tolerance.decisions=256"
part() {  # name, overrides
  setsid bash -c "$B output_dir=/tmp/b-$1 $2 > $L/build_$1_s27.log 2>&1; echo build rc \$? >> $L/build_$1_s27.log" \
    < /dev/null > /dev/null 2>&1 &
}
part aoti "stages.tilelang=false"
part tl "stages.aoti=false"
done2() { [ $(grep -l "build rc" $L/build_*_s27.log 2>/dev/null | wc -l) -eq 2 ]; }
while ! done2 && [ $(( $(date +%s) - T0 )) -lt 570 ]; do sleep 5; done
el "waited"; for f in $L/build_*_s27.log; do echo "== $f"; grep -E "^(ok|failed|skipped) |build rc|bundle written" $f; done
uptime; cp $L/*.log $L/*.md $L/*.json $OUT/ 2>/dev/null; ls $OUT
