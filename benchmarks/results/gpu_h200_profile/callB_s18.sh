#!/bin/bash
# device call B (session 18): the same-machine baseline: the bundle with the rotary computed as before
# (export.rotary=computed), profiled with this session's runtime and with session 17's (32be169's laya_aot, the
# CUDA graph replays copying inputs on the device), then the rotary-table bundle again on this machine
set -x
T0=$(date +%s)
el() { echo "[callB] $(( $(date +%s) - T0 )) s: $*"; }
python3 -c "from laya_aot.demo import make_checkpoint; make_checkpoint('/tmp/laya-large-1024-fp16','large-1024',seed=0)" > $OUT/ckpt.log 2>&1
el checkpoint
nproc; uptime
timeout 400 python3 -m laya_aot.cli build checkpoint.path=/tmp/laya-large-1024-fp16 output_dir=/tmp/bundle-computed target=sm_90 \
  stages.onnx=false stages.tilelang=false stages.inductor_cache=false export.rotary=computed > $OUT/build_computed1.log 2>&1
echo "build rc $?" >> $OUT/build_computed1.log
el build
timeout 60 python3 benchmarks/gpu_profile.py --out $OUT --tag _computed1 --bundle /tmp/bundle-computed --paths bundle --repeats 15 > $OUT/profile_computed1.log 2>&1
el profile computed
mkdir -p /tmp/old && tar -xzf .gpu-carry/old-laya_aot.tgz -C /tmp/old
(cd /tmp && PYTHONPATH=/tmp/site:/tmp/old python3 -c "import laya_aot.kinds.aoti as m; print(m.__file__, m.AOTIRunner.takes_host_inputs if hasattr(m.AOTIRunner, \"takes_host_inputs\") else \"old runner\")") > $OUT/old_runtime.log 2>&1
PYTHONPATH=/tmp/site:/tmp/old timeout 60 python3 benchmarks/gpu_profile.py --out $OUT --tag _computed1_oldhost --bundle /tmp/bundle-computed --paths bundle --repeats 15 > $OUT/profile_computed1_oldhost.log 2>&1
el profile computed old runtime
cd $OUT && tar -czf callB.tgz *.log *.json *.md 2>/dev/null; ls -la $OUT
uptime
