#!/bin/bash
# device call C (session 19): the default bundle of this session's main, built and verified alone, then its starts
# against laya eager's (first start with an empty probe cache, then a later one; issue 20) and its calls (issue 24)
T0=$(date +%s)
el() { echo "[callC] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 580 - ($(date +%s) - T0) )); }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint; nproc; uptime
timeout 420 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/b-default target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.inductor_cache=false > $OUT/build_default_s19.log 2>&1
echo "build rc $?" >> $OUT/build_default_s19.log
el build
python3 -m laya_aot.cli inspect /tmp/b-default > $OUT/inspect_default_s19.txt 2>&1
if [ -f /tmp/b-default/bundle.json ] && [ $(left) -gt 60 ]; then
  timeout 45 python3 benchmarks/gpu_profile.py --out $OUT --tag _s19 --bundle /tmp/b-default --paths bundle --repeats 15 > $OUT/profile_s19.log 2>&1
  el "profile rc $?"
  timeout $(( $(left) - 10 )) python3 benchmarks/gpu_start.py --out $OUT --bundle /tmp/b-default --starts 2 --skip-calls \
    --bytecode /tmp/pyc --tag _s19 > $OUT/start_s19.log 2>&1
  el "starts rc $?"
fi
cd $OUT && tar -czf callC.tgz *.log *.txt *.json *.md 2>/dev/null; ls -la $OUT; uptime
