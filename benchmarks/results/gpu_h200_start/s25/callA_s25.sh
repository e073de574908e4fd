#!/bin/bash
# device call A (session 25): large-1024 (fp16 on disk, served in bf16), an AOTInductor-only part built and verified
# (decision suite 256: a start does not depend on it), then later starts of the AOTInductor route (issue 20)
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
git log --oneline -1 2>/dev/null; nproc; uptime; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint
timeout 430 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/b-aoti target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.inductor_cache=false verify.tolerance.decisions=256 \
  > $OUT/build_aoti_s25.log 2>&1
echo "build rc $?" >> $OUT/build_aoti_s25.log
el build
python3 -m laya_aot.cli inspect /tmp/b-aoti > $OUT/inspect_aoti_s25.txt 2>&1
if [ -f /tmp/b-aoti/bundle.json ] && [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 10 )) python3 benchmarks/gpu_start.py --out $OUT --bundle /tmp/b-aoti --starts 3 --no-eager \
    --skip-calls --bytecode /tmp/pyc --tag _s25 > $OUT/start_s25.log 2>&1
  el "starts rc $?"
fi
cd $OUT && tar -czf callA.tgz *.log *.txt *.json *.md 2>/dev/null; ls -la $OUT; uptime
