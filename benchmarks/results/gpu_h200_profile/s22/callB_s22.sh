#!/bin/bash
# device call B (session 22): the default bundle of this session's main (batch-first head attention of session 21; GPU export traced at 8 x 1024), built and verified
# alone, then its calls (issue 24) and its starts against laya eager's (issue 20)
T0=$(date +%s)
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
left() { echo $(( 580 - ($(date +%s) - T0) )); }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint; nproc; uptime
timeout 420 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/b-default target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.inductor_cache=false > $OUT/build_default_s22.log 2>&1
echo "build rc $?" >> $OUT/build_default_s22.log
el build
python3 -m laya_aot.cli inspect /tmp/b-default > $OUT/inspect_default_s22.txt 2>&1
if [ -f /tmp/b-default/bundle.json ] && [ $(left) -gt 120 ]; then
  timeout 200 python3 benchmarks/gpu_profile.py --out $OUT --tag _s22 --bundle /tmp/b-default --paths eager,bundle --kernels --cprofile --repeats 15 > $OUT/profile_s22.log 2>&1
  el "profile rc $?"
  timeout $(( $(left) - 10 )) python3 benchmarks/gpu_start.py --out $OUT --bundle /tmp/b-default --starts 2 --skip-calls \
    --bytecode /tmp/pyc --tag _s22 > $OUT/start_s22.log 2>&1
  el "starts rc $?"
fi
cd $OUT && tar -czf callB.tgz *.log *.txt *.json *.md 2>/dev/null; ls -la $OUT; uptime
