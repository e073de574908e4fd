#!/bin/bash
# device call B (session 24, the machine of call A, next call): an fp16 checkpoint (large-1024 with amp_dtype fp16) and
# its own default bundle, then its realistic calls against laya eager's (issue 24: never slower on an fp16 checkpoint);
# then, if time is left, call A's bf16 bundle profiled (forward / host split, forward-only shapes)
T0=$(date +%s)
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 590 - ($(date +%s) - T0) )); }
python3 -c "import dataclasses; from laya_aot.demo import make_checkpoint, PRESETS; make_checkpoint(
    '/tmp/laya-large-1024-fp16amp', dataclasses.replace(PRESETS['large-1024'], amp_dtype='fp16'), seed=0)" > $OUT/ckpt_fp16amp.log 2>&1
el checkpoint
timeout 470 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16amp output_dir=/tmp/b-fp16amp target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.inductor_cache=false > $OUT/build_fp16amp_s24.log 2>&1
echo "build rc $?" >> $OUT/build_fp16amp_s24.log
el build
python3 -m laya_aot.cli inspect /tmp/b-fp16amp > $OUT/inspect_fp16amp_s24.txt 2>&1
if [ -f /tmp/b-fp16amp/bundle.json ] && [ $(left) -gt 40 ]; then
  timeout $(( $(left) - 3 )) python3 benchmarks/gpu_start.py --out $OUT --ckpt /tmp/laya-large-1024-fp16amp --bundle /tmp/b-fp16amp \
    --shape large-1024-fp16amp --starts 0 --tag _s24 > $OUT/start_fp16amp_s24.log 2>&1
  el "calls rc $?"
fi
cd $OUT && tar -czf callB.tgz *.log *.txt *.json *.md 2>/dev/null; ls -la $OUT
