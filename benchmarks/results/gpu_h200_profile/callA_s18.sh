#!/bin/bash
# device call A (session 18): the default bundle built with rotary tables (export.rotary=table, the new default) and
# profiled with the runtime whose CUDA graphs take host inputs straight into their buffers
set -x
T0=$(date +%s)
el() { echo "[callA] $(( $(date +%s) - T0 )) s: $*"; }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint
nproc; uptime
timeout 430 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/bundle-table target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.inductor_cache=false > $OUT/build_table1.log 2>&1
echo "build rc $?" >> $OUT/build_table1.log
el build
python3 -m laya_aot.cli inspect /tmp/bundle-table > $OUT/inspect_table1.txt 2>&1
el inspect
timeout 100 python3 benchmarks/gpu_profile.py --out $OUT --tag _table1 --bundle /tmp/bundle-table --paths bundle --repeats 15 > $OUT/profile_table1.log 2>&1
el profile
cd $OUT && tar -czf callA.tgz *.log *.txt *.json *.md 2>/dev/null; ls -la $OUT
uptime
