#!/bin/bash
# device call A (session 24): the default bundle of this main (large-1024, fp16 on disk, served in bf16), built and
# verified alone; then its realistic calls timed without any synchronising wrapper (gpu_start's calls: issue 24's
# 1x1 item) and one start of each path (issue 20); then laya-aot serve over HTTP at 1/8/32 clients with the default
# run after the site unpack line and: { [ -d /tmp/site/fastapi ] || tar -xJf .device-site/serve-site.tar.xz -C /tmp/site; }
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 585 - ($(date +%s) - T0) )); }
git log --oneline -1 2>/dev/null; nproc; uptime; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint
timeout 420 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/b-default target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.inductor_cache=false > $OUT/build_default_s24.log 2>&1
echo "build rc $?" >> $OUT/build_default_s24.log
el build
python3 -m laya_aot.cli inspect /tmp/b-default > $OUT/inspect_default_s24.txt 2>&1
if [ -f /tmp/b-default/bundle.json ] && [ $(left) -gt 100 ]; then
  timeout $(( $(left) - 60 )) python3 benchmarks/gpu_start.py --out $OUT --bundle /tmp/b-default --starts 1 \
    --bytecode /tmp/pyc --tag _s24 > $OUT/start_s24.log 2>&1
  el "starts and calls rc $?"
fi
if [ -f /tmp/b-default/bundle.json ] && [ $(left) -gt 45 ]; then
  timeout $(( $(left) - 5 )) python3 benchmarks/http_bench.py --device cuda --checkpoint /tmp/laya-large-1024-fp16 \
    --bundle /tmp/b-default --modes bundle --rounds 1 --requests 300 --timeout 60 --out $OUT --tag cuda_h200_s24 \
    > $OUT/http_s24.log 2>&1
  el "http rc $?"
fi
cd $OUT && tar -czf callA.tgz *.log *.txt *.json *.md 2>/dev/null; ls -la $OUT; uptime
